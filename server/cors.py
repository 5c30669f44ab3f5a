"""Cross-origin requests (CORS), as vLLM's server allows them: its ``--allowed-origins``,
``--allowed-methods``, ``--allowed-headers`` and ``--allow-credentials``, each list a JSON
array, by default every origin, method and header and no credentials. Starlette's
``CORSMiddleware`` answers the preflights (OPTIONS) and adds the headers to the answers."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware


@dataclass(frozen=True)
class CorsOptions:
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False

    def middleware(self) -> Middleware:
        return Middleware(
            CORSMiddleware,
            allow_origins=self.allowed_origins,
            allow_methods=self.allowed_methods,
            allow_headers=self.allowed_headers,
            allow_credentials=self.allow_credentials,
        )


def _json_list(value: str) -> list[str]:
    try:
        items = json.loads(value)
    except ValueError:
        items = None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, not {value!r}")
    return items


def add_cors_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's CORS options, with its names and defaults."""
    defaults = CorsOptions()
    for name, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "headers")):
        parser.add_argument(
            f"--allowed-{name}",
            type=_json_list,
            default=getattr(defaults, f"allowed_{name}"),
            help=f'CORS: the {what} allowed, a JSON list (default: ["*"], all)',
        )
    parser.add_argument(
        "--allow-credentials",
        action="store_true",
        help="CORS: allow credentials (cookies, authorization headers) across origins",
    )


def cors_options(args: argparse.Namespace) -> CorsOptions:
    return CorsOptions(
        args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials
    )
