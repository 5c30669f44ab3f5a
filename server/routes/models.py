"""GET /v1/models and /v1/models/{model}: the one model this server serves."""

from __future__ import annotations

import dataclasses
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.served_model import ServedModel


class Models:
    def __init__(self, model: ServedModel) -> None:
        self._model = model

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
            "max_model_len": self._model.max_model_len,
            # Beyond OpenAI's card: the model's own sampling defaults (generation_config.json),
            # those set only, which the web chat starts its settings from.
            "sampling_defaults": {
                name: value
                for name, value in dataclasses.asdict(self._model.sampling_defaults).items()
                if value is not None
            },
        }
