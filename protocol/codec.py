"""MessagePack encoding of typed messages, with validation on the way in.

Every message is a dataclass registered under a short tag. On the wire it is one
MessagePack map: ``{"type": tag, field: value, ...}``; nested dataclasses are maps
without a tag, and a field whose default is None is left out while it is None (decoding
gives a missing field its default). A nested dataclass marked ``@by_position`` (the
per-request outputs, sent for every request every step) is an array of its field values
in order instead, its trailing run of unset None-default fields cut: no keys to build or
pack. Decoding checks the frame size, the tag, and every field's type
against the dataclass annotations, and raises ``ProtocolError`` for anything else,
so a caller needs exactly one ``except`` to survive a malformed frame.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import reprlib
import types
import typing
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

import msgpack

# A frame above this size is refused before it is parsed. The largest legitimate
# message is the handshake reply, which carries a tokenizer.json (a few MiB at most).
MAX_FRAME_BYTES = 64 * 1024 * 1024


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol."""


# A peer's values as the messages about them quote them: cut short. The engine logs every
# frame it drops, and a frame is up to 64 MiB of, say, one message type or field name.
_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = 100


def quoted(value: Any) -> str:
    """``value``'s repr, its strings and containers cut short (reprlib), for a log line."""
    return _QUOTE.repr(value)


M = TypeVar("M", bound="Message")

_REGISTRY: dict[str, type[Message]] = {}
# Nested dataclasses that go on the wire as arrays of their fields (``by_position``).
_BY_POSITION: set[type] = set()

T = TypeVar("T", bound=type)


def by_position(cls: T) -> T:
    """Mark a nested dataclass to go on the wire as an array of its field values, in order,
    without the trailing fields whose default is None while they are None. For the values
    sent most often: an engine step sends an output for each running request, and an
    output's map of keys cost the engine's host as much as the rest of its encoding."""
    _BY_POSITION.add(cls)
    return cls


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
        body = _encoder(type(self))(self)
        body["type"] = self.TYPE
        return msgpack.packb(body, use_bin_type=True)


def build_codecs() -> None:
    """Build every message's encoder and checker now (each is built once, on its first use
    otherwise): the engine and the servers call this at start, so that their first request
    does not pay for them (in its time to first token)."""
    for cls in _REGISTRY.values():
        _encoder(cls)
        _checker(cls)


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
        raise ProtocolError(f"unknown message type {quoted(tag)}")
    return _from_wire(cls, body, cls.__name__)


# Each dataclass's encoder is built once, from its annotations, like the checkers below:
# the engine encodes an output per request and step, and walking every value to find the
# dataclasses (is_dataclass, fields()) would be Python work on every value of every output,
# every step: host time a large batch's step pays.
_Encoder = typing.Callable[[Any], Any]


@functools.cache
def _encoder(cls: type) -> _Encoder:
    """A map of the dataclass's fields (an array where ``by_position``), nested dataclasses
    encoded alike. A field whose default is None goes on the wire only when it is set
    (decoding gives an absent field its default): an engine step's outputs, one per request,
    mostly leave four of their nine fields unset, and every value costs the engine's host to
    build and pack."""
    types_of = _field_types(cls)
    unset_is_none = {field.name for field in dataclasses.fields(cls) if field.default is None}
    nested = [
        (name, encode)
        for name, hint in types_of.items()
        if (encode := _value_encoder(hint)) is not None
    ]
    if cls in _BY_POSITION:
        return _array_encoder(tuple(types_of), unset_is_none, nested)
    always = tuple(name for name in types_of if name not in unset_is_none)
    when_set = tuple(name for name in types_of if name in unset_is_none)

    def encode_dataclass(obj: Any) -> dict[str, Any]:
        body = {name: getattr(obj, name) for name in always}
        for name in when_set:
            if (value := getattr(obj, name)) is not None:
                body[name] = value
        for name, encode in nested:
            if body.get(name) is not None:
                body[name] = encode(body[name])
        return body

    return encode_dataclass


def _array_encoder(
    names: tuple[str, ...], unset_is_none: set[str], nested: list[tuple[str, _Encoder]]
) -> _Encoder:
    assert len(names) > 1, "attrgetter gives a tuple for two names or more"
    values_of = operator.attrgetter(*names)
    # The fields that may be cut from the end: the trailing run whose default is None.
    num_kept = len(names)
    while num_kept and names[num_kept - 1] in unset_is_none:
        num_kept -= 1
    unset_tail = (None,) * (len(names) - num_kept)
    nested_at = [(names.index(name), encode) for name, encode in nested]
    # Where no nested value is among the fields always sent, an unset tail leaves nothing to
    # encode: the common case, one comparison.
    plain_head = all(index >= num_kept for index, _ in nested_at)

    def encode_array(obj: Any) -> Any:
        values = values_of(obj)
        if plain_head and values[num_kept:] == unset_tail:
            return values[:num_kept]
        end = len(values)
        while end > num_kept and values[end - 1] is None:
            end -= 1
        items = list(values[:end])
        for index, encode in nested_at:
            if index < end and items[index] is not None:
                items[index] = encode(items[index])
        return items

    return encode_array


def _value_encoder(hint: Any) -> _Encoder | None:
    """How a value of type ``hint`` goes on the wire; None where it goes as it is."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        # A field holds a dataclass or None (X | None): only None needs no encoding.
        encoders = [e for option in get_args(hint) if (e := _value_encoder(option)) is not None]
        assert len(encoders) <= 1, f"unsupported union {hint!r}"
        return encoders[0] if encoders else None
    if origin is list:
        encode_item = _value_encoder(get_args(hint)[0])
        if encode_item is None:
            return None
        return lambda items: list(map(encode_item, items))
    if dataclasses.is_dataclass(hint):
        return _encoder(typing.cast(type, hint))
    return None


def _from_wire(cls: type[M], body: Any, where: str) -> M:
    try:
        return _checker(cls)(body)
    except _Mismatch as mismatch:
        raise ProtocolError(f"{where}{mismatch.path}: {mismatch.reason}") from None


class _Mismatch(Exception):
    """A value that does not fit its type, ``path`` below the message (".field[3]...")."""

    def __init__(self, reason: str, path: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.path = path


# A checker validates one value against one type and returns it converted (a map to its
# dataclass, an int to a float). Each type's checker is built once: the servers decode
# one message per engine step and request, so walking the annotations anew per value
# (get_origin, f-strings for paths never shown) was a quarter of a server's CPU.
_Checker = typing.Callable[[Any], Any]
# Every integer the engine takes fits a signed 64-bit one (its tensors' int64): MessagePack
# also carries unsigned ones up to 2**64 - 1, which would overflow a tensor in a step.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@functools.cache
def _checker(hint: Any) -> _Checker:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return _union_checker(hint)
    if origin is list:
        return _list_checker(get_args(hint)[0])
    if dataclasses.is_dataclass(hint):
        return _dataclass_checker(typing.cast(type, hint))
    if hint is type(None):

        def check_nil(value: Any) -> None:
            if value is not None:
                raise _Mismatch("expected nil")

        return check_nil
    if hint is float:

        def check_number(value: Any) -> float:
            if type(value) not in (float, int):
                raise _Mismatch("expected a number")
            return float(value)

        return check_number
    if hint is int:

        def check_int(value: Any) -> int:
            # type() rather than isinstance(): True must not pass as an int.
            if type(value) is not int:
                raise _Mismatch(f"expected int, got {type(value).__name__}")
            if not _INT64_MIN <= value <= _INT64_MAX:
                raise _Mismatch("an integer out of the 64-bit signed range")
            return value

        return check_int
    if hint in (str, bool, bytes):

        def check_exact(value: Any) -> Any:
            if type(value) is not hint:
                raise _Mismatch(f"expected {hint.__name__}, got {type(value).__name__}")
            return value

        return check_exact
    raise TypeError(f"unsupported field type {hint!r}")


def _union_checker(hint: Any) -> _Checker:
    nullable = type(None) in get_args(hint)
    options = [_checker(option) for option in get_args(hint) if option is not type(None)]

    if nullable and len(options) == 1:  # X | None: X's own mismatch names where it failed
        (check_option,) = options

        def check_optional(value: Any) -> Any:
            return None if value is None else check_option(value)

        return check_optional

    def check_union(value: Any) -> Any:
        if value is None and nullable:  # most optional fields are unset
            return None
        for check in options:
            try:
                return check(value)
            except _Mismatch:
                continue
        raise _Mismatch(f"{type(value).__name__} does not match {hint}")

    return check_union


def _list_checker(item_hint: Any) -> _Checker:
    if item_hint is int:  # the hot case (token ids): one pass, no calls per item

        def check_ints(value: Any) -> list[int]:
            if type(value) is not list:
                raise _Mismatch("expected a list")
            if not all(type(item) is int for item in value):
                raise _Mismatch("expected a list of integers")
            if value and not (min(value) >= _INT64_MIN and max(value) <= _INT64_MAX):
                raise _Mismatch("an integer out of the 64-bit signed range")
            return value

        return check_ints
    check_item = _checker(item_hint)

    def check_list(value: Any) -> list[Any]:
        if type(value) is not list:
            raise _Mismatch("expected a list")
        items = []
        for i, item in enumerate(value):
            try:
                items.append(check_item(item))
            except _Mismatch as mismatch:
                raise _Mismatch(mismatch.reason, f"[{i}]{mismatch.path}") from None
        return items

    return check_list


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """The dataclass's fields and their types, in order."""
    module = typing.cast(Any, __import__(cls.__module__, fromlist=["_"]))
    hints = get_type_hints(cls, vars(module))
    return {field.name: hints[field.name] for field in dataclasses.fields(cls)}


def _dataclass_checker(cls: type) -> _Checker:
    hints = _field_types(cls)
    fields = [
        (
            field.name,
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING,
            _checker(hints[field.name]),
        )
        for field in dataclasses.fields(cls)
    ]
    if cls in _BY_POSITION:
        return _array_checker(cls, fields)
    names = {name for name, _, _ in fields}

    def check_dataclass(body: Any) -> Any:
        if type(body) is not dict:
            raise _Mismatch("expected a map")
        if not body.keys() <= names:
            raise _Mismatch(f"unknown fields {quoted(sorted(body.keys() - names))}")
        values = {}
        for name, required, check in fields:
            if name in body:
                try:
                    values[name] = check(body[name])
                except _Mismatch as mismatch:
                    raise _Mismatch(mismatch.reason, f".{name}{mismatch.path}") from None
            elif required:
                raise _Mismatch(f"missing field {name!r}")
        return cls(**values)

    return check_dataclass


def _array_checker(cls: type, fields: list[tuple[str, bool, _Checker]]) -> _Checker:
    num_required = sum(required for _, required, _ in fields)
    assert all(required for _, required, _ in fields[:num_required]), "required fields first"

    def check_array(body: Any) -> Any:
        if type(body) is not list:
            raise _Mismatch("expected an array")
        if not num_required <= len(body) <= len(fields):
            raise _Mismatch(f"expected {num_required} to {len(fields)} values, got {len(body)}")
        values = []
        for (name, _, check), value in zip(fields, body, strict=False):
            try:
                values.append(check(value))
            except _Mismatch as mismatch:
                raise _Mismatch(mismatch.reason, f".{name}{mismatch.path}") from None
        return cls(*values)

    return check_array
