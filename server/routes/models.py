"""GET /v1/models and /v1/models/{model}: the one model this server serves."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.served_model import ServedModel


class Models:
    def __init__(self, model: ServedModel) -> None:
        self._model = model
        self._permission_id = uuid.uuid4().hex

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def retrieve_model(self, request: Request) -> Response:
        self._model.check_name(request.path_params["model"])
        return JSONResponse(self._card())

    def _card(self) -> dict[str, Any]:
        return {
            "id": self._model.name,
            "object": "model",
            "created": self._model.created,
            "owned_by": "tandem",
            # vLLM's: the model it was loaded as, no parent (no LoRA adapters here), and
            # one permission that allows what the server does.
            "root": self._model.name,
            "parent": None,
            "max_model_len": self._model.max_model_len,
            "permission": [self._permission()],
            # Beyond OpenAI's card: the model's own sampling defaults (generation_config.json),
            # those set only, which the web chat starts its settings from.
            "sampling_defaults": {
                name: value
                for name, value in dataclasses.asdict(self._model.sampling_defaults).items()
                if value is not None
            },
        }

    def _permission(self) -> dict[str, Any]:
        return {
            "id": f"modelperm-{self._permission_id}",
            "object": "model_permission",
            "created": self._model.created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
