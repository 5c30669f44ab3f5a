"""MessagePack encoding of typed messages, with validation on the way in.

Every message is a dataclass registered under a short tag. On the wire it is one
MessagePack map: ``{"type": tag, field: value, ...}``; nested dataclasses are maps
without a tag. Decoding checks the frame size, the tag, and every field's type
against the dataclass annotations, and raises ``ProtocolError`` for anything else,
so a caller needs exactly one ``except`` to survive a malformed frame.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

import msgpack

# A frame above this size is refused before it is parsed. The largest legitimate
# message is the handshake reply, which carries a tokenizer.json (a few MiB at most).
MAX_FRAME_BYTES = 64 * 1024 * 1024


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol."""


M = TypeVar("M", bound="Message")

_REGISTRY: dict[str, type[Message]] = {}


class Message:
    """Base of every message that crosses the engine socket."""

    TYPE: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        tag = cls.__dict__.get("TYPE")
        if tag is not None:
            if tag in _REGISTRY:
                raise TypeError(f"message tag {tag!r} registered twice")
            _REGISTRY[tag] = cls

    def encode(self) -> bytes:
        body = _to_wire(self)
        body["type"] = self.TYPE
        return msgpack.packb(body, use_bin_type=True)


def decode_message(frame: bytes) -> Message:
    """Parse one frame into its message class, or raise ``ProtocolError``."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be bytes, not {type(frame).__name__}")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"not MessagePack: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("a message must be a map")
    tag = body.pop("type", None)
    cls = _REGISTRY.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {tag!r}")
    return _from_wire(cls, body, cls.__name__)


def _to_wire(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [_to_wire(item) for item in obj]
    return obj


def _from_wire(cls: type[M], body: Any, where: str) -> M:
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: expected a map")
    hints = _field_types(cls)
    unknown = body.keys() - hints.keys()
    if unknown:
        raise ProtocolError(f"{where}: unknown fields {sorted(unknown)}")
    values = {}
    for name, hint in hints.items():
        if name in body:
            values[name] = _check(hint, body[name], f"{where}.{name}")
        elif not _has_default(cls, name):
            raise ProtocolError(f"{where}: missing field {name!r}")
    return cls(**values)


def _check(hint: Any, value: Any, where: str) -> Any:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        for option in get_args(hint):
            try:
                return _check(option, value, where)
            except ProtocolError:
                continue
        raise ProtocolError(f"{where}: {type(value).__name__} does not match {hint}")
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list")
        (item_hint,) = get_args(hint)
        if item_hint is int:  # the hot case (token ids): one pass, no recursion
            if not all(type(item) is int for item in value):
                raise ProtocolError(f"{where}: expected a list of integers")
            return value
        return [_check(item_hint, item, f"{where}[{i}]") for i, item in enumerate(value)]
    if dataclasses.is_dataclass(hint):
        return _from_wire(hint, value, where)
    if hint is type(None):
        if value is not None:
            raise ProtocolError(f"{where}: expected nil")
        return None
    if hint is float:
        if type(value) not in (float, int):
            raise ProtocolError(f"{where}: expected a number")
        return float(value)
    if hint in (int, str, bool, bytes):
        # type() rather than isinstance(): True must not pass as an int.
        if type(value) is not hint:
            raise ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        return value
    raise TypeError(f"unsupported field type {hint!r} at {where}")


_HINT_CACHE: dict[type, dict[str, Any]] = {}


def _field_types(cls: type) -> dict[str, Any]:
    hints = _HINT_CACHE.get(cls)
    if hints is None:
        module = typing.cast(Any, __import__(cls.__module__, fromlist=["_"]))
        all_hints = get_type_hints(cls, vars(module))
        hints = {f.name: all_hints[f.name] for f in dataclasses.fields(cls)}
        _HINT_CACHE[cls] = hints
    return hints


def _has_default(cls: type, name: str) -> bool:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return (
        field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
    )
