"""Which engine addresses need CURVE keys, and the options the engine refuses to start with."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import zmq.auth

from engine.config import ServiceConfig
from engine.service.curve_auth import SocketSecurityError, check_security, is_loopback


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("ipc:///tmp/tandem.sock", True),
        ("inproc://engine", True),
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.3.2.1:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.0.0.7:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://engine.example.com:5555", False),
    ],
)
def test_loopback_addresses(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_an_open_address_needs_keys_or_insecure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(SocketSecurityError, match="--insecure"):
        check_security(ServiceConfig(address="tcp://0.0.0.0:5555"))
    with caplog.at_level(logging.WARNING):
        check_security(ServiceConfig(address="tcp://0.0.0.0:5555", insecure=True))
    assert "INSECURE" in caplog.text
    check_security(ServiceConfig(address="tcp://127.0.0.1:5555"))  # loopback: no keys needed

    zmq.auth.create_certificates(tmp_path, "engine")
    (tmp_path / "authorized").mkdir()
    keyed = ServiceConfig(
        address="tcp://0.0.0.0:5555",
        curve_secret_key=str(tmp_path / "engine.key_secret"),
        curve_authorized_keys=str(tmp_path / "authorized"),
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_security(keyed)
    assert "no server can connect" in caplog.text  # an empty allow-list
    with pytest.raises(SocketSecurityError, match="together"):
        check_security(ServiceConfig(curve_secret_key=keyed.curve_secret_key))
    with pytest.raises(SocketSecurityError, match="no secret key"):  # the public file
        check_security(
            ServiceConfig(
                curve_secret_key=str(tmp_path / "engine.key"),
                curve_authorized_keys=keyed.curve_authorized_keys,
            )
        )
