"""config.json's values read as the types a model needs, each refused by file and key when it
is missing, of another type, or of a size no model has.

A family reads its config.json through ``ConfigValues`` rather than indexing the dict, so a
corrupt or hand-edited file fails at start, in one line naming the file and the key, instead of
with a bare KeyError or TypeError, a division by zero, or an allocation that never ends. The
checkpoint's other JSON files (tokenizer_config.json, generation_config.json, modules.json) are
read through it too, named as ``file_name``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, overload

CONFIG_JSON = "config.json"

# Bounds of the sizes that no model comes near, so that a corrupt value (2**40, say) is refused
# instead of allocated or looped over; each leaves a wide margin over the largest released model,
# so no real checkpoint meets one.
# Widths: hidden, intermediate, head and expert sizes, vocabulary, sliding window. No released
# model is 2**17 wide (Llama 3.1 405B's intermediate size, 53248, is among the widest) or has
# 2**19 tokens (Gemma 3's 262144 are among the most).
MAX_WIDTH = 2**24
# Layers: each is a module built in Python, so 2**24 of them would seem to hang; released models
# have fewer than 2**8.
MAX_LAYERS = 2**12
# Context: the RoPE tables cover this many positions unless --max-model-len caps it; the longest
# released is about 2**23 (Llama 4 Scout's 10M).
MAX_POSITIONS = 2**28
# Experts of a mixture: the router has a row each; released models have at most 2**9.
MAX_EXPERTS = 2**16

_FLOAT_BITS = 1000  # an integer of more bits than this may not convert to a float


def shown(value: Any, limit: int = 80) -> str:
    """``value``'s repr for a message, cut to ``limit`` characters: a hostile file could hold
    megabytes under one key."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def read_json(path: Path) -> Any:
    """``path``'s JSON value; a file that is not JSON is refused by name."""
    try:
        with path.open(encoding="utf-8") as file:
            return json.load(file)
    # ValueError: not UTF-8, not JSON, or an integer of more digits than Python converts;
    # RecursionError: arrays or objects nested deeper than Python's stack.
    except (ValueError, RecursionError) as error:
        raise ValueError(f"{path}: not valid JSON: {error}") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """``path``'s JSON object; a file that is no JSON object is refused by name."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, not {type(value).__name__}")
    return value


def read_json_object_if_present(path: Path) -> dict[str, Any]:
    return read_json_object(path) if path.is_file() else {}


class ConfigValues:
    """config.json's values, or those of a section of it (``within``, e.g. "rope_scaling", names
    it in messages); ``path`` is the checkpoint directory, ``file_name`` the file within it
    (another JSON file of the checkpoint's, read alike). Each read is refused with a ValueError
    naming the file and the key, in the words of ``GGUFMetadata``'s for a GGUF file."""

    def __init__(
        self,
        values: Mapping[str, Any],
        path: Path,
        within: str | None = None,
        file_name: str = CONFIG_JSON,
    ) -> None:
        self.values, self.path, self.within, self.file_name = values, path, within, file_name

    @property
    def file(self) -> Path:
        return self.path / self.file_name

    def size(
        self, key: str, at_most: int = MAX_WIDTH, at_least: int = 1, bound: str | None = None
    ) -> int:
        """A count or length, required: an integer from ``at_least`` to ``at_most``; ``bound``
        names what ``at_most`` is, where it is another value of the file."""
        return self._size(key, self._required(key), at_least, at_most, bound)

    @overload
    def optional_size(
        self, key: str, default: int, at_most: int = MAX_WIDTH, at_least: int = 1
    ) -> int: ...
    @overload
    def optional_size(
        self, key: str, default: None = None, at_most: int = MAX_WIDTH, at_least: int = 1
    ) -> int | None: ...
    def optional_size(
        self, key: str, default: int | None = None, at_most: int = MAX_WIDTH, at_least: int = 1
    ) -> int | None:
        """A count or length, ``default`` when missing or null (as transformers reads them)."""
        value = self.values.get(key)
        return default if value is None else self._size(key, value, at_least, at_most)

    def number(self, key: str) -> float:
        """A positive finite number, required (an epsilon, a RoPE base, a scale)."""
        return self._number(key, self._required(key), positive=True)

    @overload
    def optional_number(self, key: str, default: float, positive: bool = True) -> float: ...
    @overload
    def optional_number(
        self, key: str, default: None = None, positive: bool = True
    ) -> float | None: ...
    def optional_number(
        self, key: str, default: float | None = None, positive: bool = True
    ) -> float | None:
        """A finite number, positive unless ``positive`` is False; ``default`` when missing or
        null."""
        value = self.values.get(key)
        return default if value is None else self._number(key, value, positive)

    def flag(self, key: str, default: bool) -> bool:
        """true or false; ``default`` when missing or null. A string "false" would read as true."""
        value = self.values.get(key)
        if value is None:
            return default
        if type(value) is not bool:
            raise self.refused(key, value, "not true or false")
        return value

    def name(self, key: str, default: str) -> str:
        """A string (an activation's name, say); ``default`` when missing or null."""
        value = self.values.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.refused(key, value, "not a string")
        return value

    def text(self, key: str) -> str:
        """A string, required (a named chat template's name, a special token's content)."""
        value = self._required(key)
        if not isinstance(value, str):
            raise self.refused(key, value, "not a string")
        return value

    def token_ids(self, key: str, vocab_size: int) -> list[int]:
        """An id of the ``vocab_size``-token vocabulary or a list of them (eos_token_id), []
        when missing or null. An id outside it could never be sampled, or would index past the
        logits where the engine bans it."""
        value = self.values.get(key)
        if value is None:
            return []
        ids = value if isinstance(value, list) else [value]
        # bool is an int to Python: true is no token id.
        if not all(type(item) is int and 0 <= item < vocab_size for item in ids):
            problem = f"not a token id of the {vocab_size}-token vocabulary, or a list of them"
            raise self.refused(key, value, problem)
        return ids

    def sizes(self, key: str, at_most: int, at_least: int = 0) -> list[int]:
        """A list of counts or indices, [] when missing or null."""
        value = self.values.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.refused(key, value, "not a list of integers")
        return [self._size(key, item, at_least, at_most) for item in value]

    def section(self, key: str) -> dict[str, Any]:
        """A JSON object within (quantization_config, rope_scaling), {} when missing or null."""
        value = self.values.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.refused(key, value, "not a JSON object")
        return value

    def _required(self, key: str) -> Any:
        if key not in self.values:
            raise ValueError(f"{self.file}: {self._label(key)} is missing")
        return self.values[key]

    def _size(
        self, key: str, value: Any, at_least: int, at_most: int, bound: str | None = None
    ) -> int:
        # bool is an int to Python, and 64.0 a float that json.load keeps as one: neither is a
        # count that config.json writes.
        if type(value) is not int or value < at_least:
            expected = (
                "a positive integer" if at_least == 1 else f"an integer of {at_least} or more"
            )
            raise self.refused(key, value, f"not {expected}")
        if value > at_most:
            limit = f"any model has (at most {at_most})" if bound is None else f"{bound}, {at_most}"
            raise self.refused(key, value, f"more than {limit}")
        return value

    def _number(self, key: str, value: Any, positive: bool) -> float:
        # json.load reads NaN and Infinity, and integers too long for a float (float() of one
        # would raise OverflowError).
        if (
            type(value) not in (int, float)
            or (type(value) is int and value.bit_length() > _FLOAT_BITS)
            or not math.isfinite(value)
        ):
            raise self.refused(key, value, "not a finite number")
        if positive and value <= 0:
            raise self.refused(key, value, "not a positive number")
        return float(value)

    def refused(self, key: str, value: Any, problem: str) -> ValueError:
        """The error of ``key``'s ``value``, named by file and key, with what is wrong with it."""
        return ValueError(f"{self.file}: {self._label(key)} is {shown(value)}, {problem}")

    def _label(self, key: str) -> str:
        return repr(key) if self.within is None else f"{self.within}'s {key!r}"


def expert_counts(values: ConfigValues, experts_key: str) -> tuple[int, int]:
    """A mixture's experts (under ``experts_key``, the family's name for them) and how many of
    them each token is routed to: no more than there are, or the top-k would fail mid-step."""
    experts = values.size(experts_key, MAX_EXPERTS)
    return experts, values.size("num_experts_per_tok", experts, bound=repr(experts_key))
