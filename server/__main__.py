"""``python -m server --engine ADDRESS [--engine ADDRESS ...] --port P``: one stateless HTTP server.

It handshakes with the engine before it listens, so that a server that accepts
connections always knows its model; the engine may still be loading weights, so
the handshake waits (up to --handshake-timeout). With several engine addresses
(data-parallel replicas of one model), it handshakes with every one and spreads the
requests over them (server/engine_pool.py). SIGTERM drains it (server/drain.py).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import os
import resource
import socket
import sys

import uvicorn

from protocol.flags import bounded
from server.app import create_app
from server.connection_limits import ConnectionLimits, GuardedHttpToolsProtocol
from server.cors import add_cors_arguments, cors_options
from server.drain import Drain, DrainingServer
from server.engine_client import CurveKeys, HandshakeError
from server.engine_pool import EnginePool
from server.loop_lag import sample_loop_lag
from server.reasoning_parsers import REASONING_PARSERS
from server.response_store import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_RESPONSES,
    DEFAULT_TTL_S,
    ResponseStore,
)
from server.served_model import ChatOptions, load_chat_template
from server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("server")

# Seconds uvicorn gives open connections after the drain (--drain-timeout) before it
# cancels them, which aborts their requests in the engine.
_GRACEFUL_SHUTDOWN_S = 2
# Files a server holds besides its connections: sockets to the engines, logs, libraries.
_OTHER_FILES = 256


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m server", description="OpenAI-compatible HTTP server for a Tandem engine."
    )
    parser.add_argument(
        "--engine",
        required=True,
        action="append",
        help="the engine's ZeroMQ address, e.g. tcp://127.0.0.1:5555; data-parallel replicas of "
        "one model: the option once for each, or their addresses separated by commas",
    )
    parser.add_argument(
        "--port",
        type=bounded(int, at_least=1, at_most=65535),
        required=True,
        help="HTTP port to listen on",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="HTTP address to listen on (default: 127.0.0.1)"
    )
    parser.add_argument(
        "--handshake-timeout",
        type=bounded(float, above=0),
        default=600.0,
        help="seconds to wait for the engine to answer the handshake (default: 600)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="answer API requests only with 'Authorization: Bearer KEY' "
        "(default: $TANDEM_API_KEY; none: open)",
    )
    parser.add_argument(
        "--chat-template",
        help="the chat template to render messages with instead of the model's: a Jinja file, "
        "or the name of one packaged with the server (chatml_tools: ChatML with tools, "
        "calls in <tool_call> tags)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        help="how the model writes tool calls, for tool_choice auto (default: from the "
        "chat template's markers)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help="split the answer's reasoning into reasoning_content (default: if the chat "
        "template has </think>)",
    )
    parser.add_argument(
        "--engine-public-key",
        metavar="FILE",
        help="CURVE: the engine's public key (its .key file), the same for every --engine "
        "(replicas share one key pair); with --curve-secret-key, the connections to the "
        "engines are encrypted and authenticated (scripts/make_curve_keys.py)",
    )
    parser.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="CURVE: this server's key pair (a .key_secret file), whose public key must be "
        "in every engine's --curve-authorized-keys directory",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=bounded(int, at_least=1),
        help="refuse larger request bodies with 413 (default: 4 MiB plus 32 bytes per token "
        "of the model's context)",
    )
    parser.add_argument(
        "--max-generated-tokens",
        type=bounded(int, at_least=1),
        help="refuse requests that may generate more tokens in all (n times max_tokens, or "
        "n times what the context leaves without max_tokens) with 400 (default: 4 times the "
        "model's context)",
    )
    limits = ConnectionLimits()
    parser.add_argument(
        "--header-timeout",
        type=bounded(float, above=0),
        default=limits.header_timeout_s,
        help="seconds a connection may take to send a request's headers (from its opening, "
        "or from a keep-alive request's first byte); then 408 and closed "
        f"(default: {limits.header_timeout_s:g})",
    )
    parser.add_argument(
        "--body-timeout",
        type=bounded(float, above=0),
        default=limits.body_timeout_s,
        help="seconds a request body may pause between two reads; also how long into the "
        f"body --min-body-rate starts to hold; then 408 and closed "
        f"(default: {limits.body_timeout_s:g})",
    )
    parser.add_argument(
        "--min-body-rate",
        type=bounded(float, at_least=0),
        default=limits.min_body_rate,
        help="bytes a second a request body must come at on average, from --body-timeout "
        f"into it (default: {limits.min_body_rate:g})",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=bounded(float, above=0),
        default=limits.keep_alive_timeout_s,
        help="seconds a keep-alive connection may stay idle between two requests "
        f"(default: {limits.keep_alive_timeout_s:g})",
    )
    parser.add_argument(
        "--max-connections",
        type=bounded(int, at_least=1),
        default=limits.max_connections,
        help="open connections at most; past it a new one gets 503 and is closed "
        f"(default: {limits.max_connections})",
    )
    parser.add_argument(
        "--send-timeout",
        type=bounded(float, above=0),
        default=limits.send_timeout_s,
        help="seconds a response's client may read nothing of it while its send buffer is "
        f"full; then the connection is closed and the request aborted "
        f"(default: {limits.send_timeout_s:g})",
    )
    parser.add_argument(
        "--drain-timeout",
        type=bounded(float, at_least=0),
        default=600.0,
        help="on SIGTERM, seconds that requests in flight may take to finish while new ones "
        "are refused; then streams end with a server_draining error event and the others "
        "get a 503 (default: 600, for long answers)",
    )
    add_cors_arguments(parser)
    parser.add_argument(
        "--responses-store-max",
        type=bounded(int, at_least=0),
        default=DEFAULT_MAX_RESPONSES,
        help="Responses API: the most stored responses this server keeps for "
        f"previous_response_id and GET /v1/responses/ID, the oldest forgotten first; 0 stores "
        f"none (default: {DEFAULT_MAX_RESPONSES})",
    )
    parser.add_argument(
        "--responses-store-max-bytes",
        type=bounded(int, at_least=0),
        default=DEFAULT_MAX_BYTES,
        help="Responses API: the most bytes of stored responses this server keeps, each "
        "counted as its JSON and its whole conversation's, the oldest forgotten first; one "
        f"larger on its own is not kept; 0 stores none (default: {DEFAULT_MAX_BYTES}, 256 MiB)",
    )
    parser.add_argument(
        "--responses-store-ttl",
        type=bounded(float, above=0),
        default=DEFAULT_TTL_S,
        help=f"Responses API: seconds a stored response is kept (default: {DEFAULT_TTL_S:g})",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level (default: info)",
    )
    args = parser.parse_args(argv)
    if (args.engine_public_key is None) != (args.curve_secret_key is None):
        parser.error("give --engine-public-key and --curve-secret-key together")
    args.engine = [address for option in args.engine for address in option.split(",") if address]
    if len(set(args.engine)) != len(args.engine):
        parser.error(f"an engine address is given twice: {', '.join(args.engine)}")
    return args


async def _serve(args: argparse.Namespace) -> int:
    if args.chat_template is not None:
        try:
            load_chat_template(args.chat_template)  # fail now, not after the handshake
        except ValueError as exc:
            logger.error("cannot serve: %s", exc)
            return 2
    options = ChatOptions(
        args.chat_template, args.tool_call_parser, args.reasoning_parser, args.max_generated_tokens
    )
    client_name = f"tandem-server {socket.gethostname()}:{os.getpid()} port {args.port}"
    curve = None
    if args.curve_secret_key is not None:
        curve = CurveKeys(args.curve_secret_key, args.engine_public_key)
    try:
        client = EnginePool(args.engine, client_name, curve)
    except (OSError, ValueError) as exc:  # unreadable key files
        logger.error("cannot serve: %s", exc)
        return 2
    try:
        logger.info("connecting to the engine at %s", ", ".join(args.engine))
        try:
            handshake = await client.connect(args.handshake_timeout)
        except HandshakeError as exc:
            logger.error("cannot serve: %s", exc)
            return 1
        logger.info(
            "serving %s (context %d tokens, %d engine replica%s) on http://%s:%d",
            handshake.model_name,
            handshake.max_model_len,
            len(args.engine),
            "" if len(args.engine) == 1 else "s",
            args.host,
            args.port,
        )
        drain = Drain(args.drain_timeout, client.fail_requests)
        app = create_app(
            client,
            handshake,
            args.api_key,
            options,
            args.max_request_bytes,
            drain,
            cors_options(args),
            ResponseStore(
                args.responses_store_max,
                args.responses_store_ttl,
                args.responses_store_max_bytes,
            ),
        )
        limits = ConnectionLimits(
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            min_body_rate=args.min_body_rate,
            keep_alive_timeout_s=args.keep_alive_timeout,
            max_connections=args.max_connections,
            send_timeout_s=args.send_timeout,
        )
        _allow_open_files(limits.max_connections)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
            timeout_keep_alive=limits.keep_alive_timeout_s,
            # httptools (C), not h11 (Python): a streamed chunk costs the server less CPU
            # (scripts/bench_serving.py's "server us/chunk" column measures it); with the
            # header and body timeouts and the cap on connections (server/connection_limits.py).
            http=functools.partial(GuardedHttpToolsProtocol, limits=limits),
            # Our logging is configured in main(); keep uvicorn's from replacing it.
            log_config=None,
        )
        # What start-up built (the model's tokenizer and template, the routes, the schemas)
        # lives as long as the process: out of the collector's reach, a full collection does
        # not walk it again each time the garbage of streamed chunks sets one off (vLLM's
        # server does the same).
        gc.collect()
        gc.freeze()
        lag = asyncio.create_task(sample_loop_lag(client.metrics), name="loop-lag")
        try:
            # uvicorn exits by itself (status 1) when it cannot listen on the port.
            await DrainingServer(config, drain).serve()
        finally:
            lag.cancel()
        return 0
    finally:
        await client.close()


def _allow_open_files(max_connections: int) -> None:
    """Raises this process's soft limit on open files towards its hard limit, so that
    ``max_connections`` connections (each a file), plus the engine sockets and the files a
    server opens, fit: a common soft limit of 1,024 would otherwise fail accept() first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + _OTHER_FILES
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < wanted:
            logger.warning(
                "at most %d open files (ulimit -Hn): --max-connections %d may not be reached",
                new,
                max_connections,
            )


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:  # Ctrl-C while waiting for the handshake
        return 130


if __name__ == "__main__":
    sys.exit(main())
