"""CURVE on the engine socket: libzmq's own encryption and authentication of connections.

Both ends load the key files that ``zmq.auth.create_certificates`` writes
(``scripts/make_curve_keys.py``): NAME.key holds a public key, NAME.key_secret the pair.
The engine's ROUTER is the CURVE server (its secret key; which client keys it accepts is
the authenticator's job, engine/service/curve_auth.py); a server's DEALER is a CURVE client (its
own key pair and the engine's public key). This file is here, in the wire's package, because
both sides must configure the same mechanism the same way, and it needs nothing but pyzmq.
"""

from __future__ import annotations

from pathlib import Path

import zmq
import zmq.auth


def load_key_pair(secret_key_file: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file; ValueError if it holds no secret key."""
    public, secret = zmq.auth.load_certificate(secret_key_file)
    if secret is None:
        raise ValueError(f"{secret_key_file} holds no secret key: give the .key_secret file")
    return public, secret


def load_public_key(key_file: str | Path) -> bytes:
    """The public key in a ``.key`` (or ``.key_secret``) file."""
    public, _ = zmq.auth.load_certificate(key_file)
    return public


def make_curve_server(socket: zmq.Socket, secret_key_file: str | Path) -> None:
    """Every connection to ``socket`` (bound afterwards) is encrypted and must authenticate."""
    public, secret = load_key_pair(secret_key_file)
    socket.curve_publickey = public
    socket.curve_secretkey = secret
    socket.curve_server = True


def make_curve_client(
    socket: zmq.Socket, secret_key_file: str | Path, server_public_key_file: str | Path
) -> None:
    """``socket`` (connected afterwards) talks only to the holder of the server's secret key,
    and proves its own key pair, which the server's allow-list must hold."""
    public, secret = load_key_pair(secret_key_file)
    socket.curve_publickey = public
    socket.curve_secretkey = secret
    socket.curve_serverkey = load_public_key(server_public_key_file)
