"""The engine's ZeroMQ address: checked free before the weights load, and its ipc:// file
removed when the engine stops (libzmq leaves it behind, even on unbind)."""

from __future__ import annotations

import socket
from pathlib import Path


class AddressUnavailableError(Exception):
    """The engine cannot bind its --address: another process listens there, or (tcp://) the
    host has no such interface."""


def check_address_free(address: str) -> None:
    """Raises AddressUnavailableError where the engine could not bind ``address``.

    ZeroMQ would refuse a tcp:// port in use only once the engine binds, after its weights
    load, and would take an ipc:// path over from a live engine (it replaces the file),
    leaving that engine unreachable for its servers.
    """
    if address.startswith("ipc://"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(_unix_path(address))
            except OSError:
                return  # no file, or one no process listens at (a killed engine's)
        raise AddressUnavailableError(f"--address {address}: another process listens there")
    if address.startswith("tcp://"):
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        if not port.isdigit():  # "*", a port ZeroMQ picks; anything else ZeroMQ refuses
            return
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # As libzmq binds: a port whose last connections linger in TIME_WAIT is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("" if host == "*" else host, int(port)))
            except socket.gaierror:
                return  # an interface's name (tcp://eth0:5555), which ZeroMQ resolves itself
            except OSError as exc:
                raise AddressUnavailableError(f"--address {address}: {exc.strerror}") from None


def remove_socket_file(address: str) -> None:
    """Removes an ipc:// address's file, once the engine's socket is closed."""
    if address.startswith("ipc://"):
        path = _unix_path(address)
        if not path.startswith("\0"):  # an abstract name is no file
            Path(path).unlink(missing_ok=True)


def _unix_path(address: str) -> str:
    """An ipc:// address's socket path; ``ipc://@NAME`` is Linux's abstract namespace."""
    path = address.removeprefix("ipc://")
    return "\0" + path[1:] if path.startswith("@") else path
