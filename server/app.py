"""The Starlette application: routes, error handlers, and the web UI's files."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.routing import Route
from starlette.types import ASGIApp

from protocol import HandshakeReply
from server.admission_gate import AdmissionGate
from server.api_key import ApiKeyCheck
from server.body_limit import BodySizeLimit, default_max_request_bytes
from server.cors import CorsOptions
from server.drain import Drain, DrainGate
from server.engine_pool import EnginePool
from server.errors import (
    ApiError,
    handle_api_error,
    handle_client_disconnect,
    handle_http_exception,
    handle_unexpected,
)
from server.metrics import HttpStatusCounter
from server.request_id import RequestIdHeader
from server.response_store import DEFAULT_MAX_RESPONSES, DEFAULT_TTL_S, ResponseStore
from server.routes.chat import ChatCompletions
from server.routes.completions import Completions
from server.routes.embeddings import Embeddings
from server.routes.health import Health
from server.routes.models import Models
from server.routes.responses import Responses
from server.routes.stats import Stats
from server.routes.tokenize import Tokenization
from server.routes.version import server_version
from server.served_model import ChatOptions, ServedModel
from server.sse import server_send
from server.web_ui import web_ui_routes


def create_app(
    client: EnginePool,
    handshake: HandshakeReply,
    api_key: str | None = None,
    chat_options: ChatOptions | None = None,
    max_request_bytes: int | None = None,
    drain: Drain | None = None,
    cors: CorsOptions | None = None,
    response_store: ResponseStore | None = None,
) -> ASGIApp:
    """The HTTP application serving ``handshake``'s model through ``client``; with
    ``api_key``, the API answers only requests that carry it. Bodies over
    ``max_request_bytes`` (default: a few MB over the model's context) are refused; with
    ``drain``, the server refuses new requests once it drains (server/drain.py); ``cors``:
    which cross-origin requests are allowed (server/cors.py; default: vLLM's, all);
    ``response_store``: where stored responses are kept (server/response_store.py)."""
    model = ServedModel.from_handshake(handshake, chat_options)
    chat = ChatCompletions(client, model)
    completions = Completions(client, model)
    responses = Responses(
        client, model, response_store or ResponseStore(DEFAULT_MAX_RESPONSES, DEFAULT_TTL_S)
    )
    embeddings = Embeddings(client, model)
    models = Models(model)
    tokenization = Tokenization(model)
    health = Health(client, drain)
    stats = Stats(client)
    routes = [
        Route("/v1/chat/completions", chat.create, methods=["POST"]),
        Route("/v1/completions", completions.create, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/embeddings", embeddings.create, methods=["POST"]),
        Route("/v1/models", models.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", models.retrieve_model, methods=["GET"]),
        Route("/tokenize", tokenization.tokenize, methods=["POST"]),
        Route("/detokenize", tokenization.detokenize, methods=["POST"]),
        Route("/health", health.health, methods=["GET"]),
        Route("/ready", health.ready, methods=["GET"]),
        Route("/ping", health.health, methods=["GET", "POST"]),  # vLLM's alias of /health
        Route("/metrics", health.metrics, methods=["GET"]),
        Route("/stats", stats.stats, methods=["GET"]),
        Route("/version", server_version, methods=["GET"]),
        *web_ui_routes(),
    ]
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(handshake.max_model_len)
    # CORS outermost: a preflight carries no API key.
    middleware = [(cors or CorsOptions()).middleware()]
    if api_key:
        middleware.append(Middleware(ApiKeyCheck, api_key=api_key))
    # After the API key (a stranger learns nothing of the load), before the body is read.
    middleware.append(Middleware(AdmissionGate, pool=client))
    # Inside Starlette's error middleware, so that the 413 it raises is an OpenAI error body.
    middleware.append(Middleware(BodySizeLimit, max_bytes=max_request_bytes))
    app: ASGIApp = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            ApiError: handle_api_error,
            HTTPException: handle_http_exception,
            ClientDisconnect: handle_client_disconnect,
            Exception: handle_unexpected,
        },
    )
    if drain is not None:
        app = DrainGate(app, drain)
    # Outside Starlette's own error middleware, so that every response, the 500s too,
    # carries the id and is counted. Every middleware here acts on a response's start
    # alone: an event stream sends its bodies past them (server_send).
    return server_send(RequestIdHeader(HttpStatusCounter(app, client.metrics)))
