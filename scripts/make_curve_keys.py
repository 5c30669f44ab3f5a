"""CURVE key pairs for the engine socket, made by pyzmq (``zmq.auth.create_certificates``).

    python scripts/make_curve_keys.py DIR [--servers NAME ...]

writes into DIR:

- ``engine.key_secret`` (the engine's pair: ``--curve-secret-key`` of ``python -m engine``)
  and ``engine.key`` (its public key: every server's ``--engine-public-key``);
- for each server NAME (default: one named ``server``), ``NAME.key_secret`` (that server's
  ``--curve-secret-key``) and ``authorized/NAME.key`` (its public key, in the directory that
  is the engine's ``--curve-authorized-keys``).

Secret files are readable by their owner only; copy each to its own host. A server added
later: run with ``--servers NEW`` on the same DIR (an existing engine pair is kept), and put
``authorized/NEW.key`` into the engine's directory (the engine reads it at start-up).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import zmq.auth


def make_pair(directory: Path, name: str) -> tuple[Path, Path]:
    """``name.key`` and ``name.key_secret`` in ``directory``, the secret one private."""
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--servers", nargs="+", default=["server"], metavar="NAME")
    args = parser.parse_args(argv)
    authorized = args.directory / "authorized"
    authorized.mkdir(parents=True, exist_ok=True)
    os.chmod(args.directory, 0o700)
    if (args.directory / "engine.key_secret").exists():
        print(f"kept the engine's pair in {args.directory}")
    else:
        make_pair(args.directory, "engine")
        print(f"engine: {args.directory / 'engine.key_secret'} (public: engine.key)")
    for name in args.servers:
        if name == "engine" or (args.directory / f"{name}.key_secret").exists():
            parser.error(f"{name!r} exists or is the engine's name")
        public, secret = make_pair(args.directory, name)
        shutil.move(public, authorized / public.name)
        print(f"server {name}: {secret} (public: {authorized / public.name})")


if __name__ == "__main__":
    main()
