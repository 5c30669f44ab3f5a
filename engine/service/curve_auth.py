"""Who may talk to the engine: CURVE with an allow-list of servers' public keys.

libzmq encrypts and authenticates each connection (protocol/curve.py sets the keys);
pyzmq's authenticator (``zmq.auth``) answers libzmq's ZAP requests from the allow-list
directory, so a server whose key is not there is refused before any message of it is
read. A ``tcp://`` address that other hosts can reach is refused without keys, unless the
operator says ``--insecure``. Every refused connection is logged: the authenticator's
refusals, and libzmq's failed handshakes (no CURVE at all, or the wrong engine key).
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import os
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from engine.config import ServiceConfig
from protocol.curve import load_key_pair, make_curve_server

logger = logging.getLogger(__name__)

# libzmq's protocol error codes (a failed handshake's value), by name.
_PROTOCOL_ERRORS = {
    getattr(zmq, name): name.removeprefix("PROTOCOL_ERROR_").lower()
    for name in dir(zmq)
    if name.startswith("PROTOCOL_ERROR_")
}
_REPEAT_LOG_INTERVAL_S = 10.0


class SocketSecurityError(Exception):
    """Options the engine will not serve with: a network address without keys (and without
    --insecure), or keys it cannot load."""


def check_security(config: ServiceConfig) -> None:
    """Before anything loads: raises SocketSecurityError for options the socket cannot be
    served with; warns about a network address left open by --insecure."""
    curve = config.curve_secret_key is not None
    if curve != (config.curve_authorized_keys is not None):
        raise SocketSecurityError("give --curve-secret-key and --curve-authorized-keys together")
    if config.curve_secret_key is not None and config.curve_authorized_keys is not None:
        try:
            load_key_pair(config.curve_secret_key)
        except (OSError, ValueError) as exc:
            raise SocketSecurityError(f"cannot load the engine's key: {exc}") from None
        if not Path(config.curve_authorized_keys).is_dir():
            raise SocketSecurityError(f"{config.curve_authorized_keys} is not a directory")
        if not zmq.auth.load_certificates(config.curve_authorized_keys):
            logger.warning(
                "no public key in %s: no server can connect", config.curve_authorized_keys
            )
    check_address(config.address, curve, config.insecure)


def is_loopback(address: str) -> bool:
    """Whether only this host can reach ``address``: ipc://, inproc://, or tcp:// on a
    loopback interface (a wildcard or a hostname other than localhost is not)."""
    if not address.startswith("tcp://"):
        return True
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a hostname
        return False


def check_address(address: str, curve: bool, insecure: bool) -> None:
    """Raises SocketSecurityError for a network address without keys; warns under
    --insecure."""
    if curve or is_loopback(address):
        return
    if not insecure:
        raise SocketSecurityError(
            f"refusing to listen on {address} without CURVE keys: any host that reaches it "
            "could generate and read the traffic. Give --curve-secret-key and "
            "--curve-authorized-keys (keys from scripts/make_curve_keys.py), or --insecure "
            "on a network you trust"
        )
    logger.warning(
        "INSECURE: %s is open to any host that reaches it, unencrypted and unauthenticated "
        "(--insecure); anyone there can generate and read every request",
        address,
    )


class CurveGuard:
    """CURVE on a ROUTER socket, its allow-list, and the log of refused connections."""

    # The socket monitor's events of a refused peer, for log_failed_handshake.
    HANDSHAKE_FAILURES = (
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )

    def __init__(
        self,
        context: zmq.Context,
        socket: zmq.Socket,
        secret_key_file: str,
        authorized_keys_dir: str,
    ) -> None:
        self._authenticator = ThreadAuthenticator(context, log=_RefusalLog(logger, {}))
        self._authenticator.start()
        # Only the public keys in this directory may connect, from any address ("*").
        self._authenticator.configure_curve(domain="*", location=authorized_keys_dir)
        make_curve_server(socket, secret_key_file)
        # A refused peer reconnects every 100 ms or so: each reason is logged once in a while,
        # with how many refusals it stands for.
        self._last_logged: dict[str, float] = {}
        self._unlogged: collections.Counter[str] = collections.Counter()

    def close(self) -> None:
        """Before the socket closes: stops the authenticator."""
        self._authenticator.stop()

    def log_failed_handshake(self, event: dict[str, Any]) -> None:
        """Log one of the socket monitor's HANDSHAKE_FAILURES events (the engine's service
        owns the monitor: libzmq allows one per socket)."""
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = f"authentication refused (ZAP status {event['value']})"
        elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # An errno: the peer hung up mid-handshake, as one without CURVE (or with
            # another engine's key) does when it sees the engine's greeting first.
            why = (
                f"handshake failed ({os.strerror(event['value'])}): the peer may not use "
                "CURVE, or not this engine's key"
            )
        else:
            why = _PROTOCOL_ERRORS.get(event["value"], f"protocol error {event['value']:#x}")
            if why == "zmtp_mechanism_mismatch":
                why += ": the peer does not use CURVE"
            elif why == "zmtp_cryptographic":
                why += ": the peer has a different engine public key"
        now = time.monotonic()
        last = self._last_logged.get(why, -_REPEAT_LOG_INTERVAL_S)
        if now - last < _REPEAT_LOG_INTERVAL_S:
            self._unlogged[why] += 1
            return
        self._last_logged[why] = now
        again = f" ({self._unlogged.pop(why)} more times since)" if self._unlogged[why] else ""
        logger.warning("refused a connection on %s: %s%s", event["endpoint"].decode(), why, again)


class _RefusalLog(logging.LoggerAdapter):
    """The authenticator's log, its refusals raised from debug (pyzmq's level) to warnings:
    an operator must see who knocked with an unknown key."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        text = str(msg) % args if args else str(msg)
        if text.startswith("DENIED"):  # e.g. "DENIED (CURVE) domain=* client_key=..."
            level, msg, args = logging.WARNING, "refused a connection: %s", (text,)
        super().log(level, msg, *args, **kwargs)
