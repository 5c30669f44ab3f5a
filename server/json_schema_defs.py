"""JSON schemas placed inside a larger one, with their definitions moved to its root.

A schema's local references (``#/$defs/Address``, ``#/properties/...``, ``#``) are
relative to its own root. Set inside another schema (each tool's parameters inside the
one schema of tool_choice "required"), they would point into the new root, where
nothing is: the grammar library then refuses the schema ("Cannot find field '$defs'"),
and every nested pydantic model writes such references. So, as vLLM does, each embedded
schema's ``$defs`` (and the older ``definitions``) move to the root's ``$defs``, and its
references are rewritten to match: a definition's to its place at the root (renamed when
another embedded schema already took its name; vLLM refuses two different bodies under
one name instead), any other to the schema's new place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DEFINITION_SECTIONS = ("$defs", "definitions")
# Keywords whose values are data, not schemas: a "$ref" key in them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples"})


class HoistedDefs:
    """The root ``$defs`` of a schema built from others; ``embed`` each one, then put
    ``defs`` (if any) at the root."""

    def __init__(self) -> None:
        self.defs: dict[str, Any] = {}

    def embed(self, schema: Mapping[str, Any], pointer: str) -> dict[str, Any]:
        """``schema`` as it must read at ``pointer`` (a JSON pointer, "/items/anyOf/0")
        of the root: without its definitions, which join ``defs``, and with its local
        references rewritten."""
        renames: dict[tuple[str, str], str] = {}
        bodies: dict[tuple[str, str], Any] = {}
        for section in DEFINITION_SECTIONS:
            for name, body in (schema.get(section) or {}).items():
                renames[(section, name)] = self._free_name(name)
                bodies[(section, name)] = body
        for key, body in bodies.items():
            self.defs[renames[key]] = _rewritten(body, renames, pointer)
        kept = {key: value for key, value in schema.items() if key not in DEFINITION_SECTIONS}
        return _rewritten(kept, renames, pointer)

    def _free_name(self, name: str) -> str:
        """``name`` at the root, or the first of ``name_2``, ``name_3``... not taken. A
        taken name is never shared, even by an equal body: equal bodies mean the same
        only if the definitions they refer to do too."""
        candidate, number = name, 1
        while candidate in self.defs:
            number += 1
            candidate = f"{name}_{number}"
        # Reserved now, so that a later definition of this schema cannot take it too.
        self.defs[candidate] = None
        return candidate


def _rewritten(value: Any, renames: Mapping[tuple[str, str], str], pointer: str) -> Any:
    if isinstance(value, list):
        return [_rewritten(item, renames, pointer) for item in value]
    if not isinstance(value, Mapping):
        return value
    rewritten: dict[str, Any] = {}
    for key, item in value.items():
        if key == "$ref" and isinstance(item, str):
            rewritten[key] = _reference(item, renames, pointer)
        elif key in _DATA_KEYWORDS:
            rewritten[key] = item
        else:
            rewritten[key] = _rewritten(item, renames, pointer)
    return rewritten


def _reference(ref: str, renames: Mapping[tuple[str, str], str], pointer: str) -> str:
    """A local reference as it reads from the root; others (URLs) are left as they are."""
    if not ref.startswith("#"):
        return ref
    parts = ref[1:].split("/")
    # "#/$defs/Name/rest": parts are "", "$defs", "Name", "rest"...
    if len(parts) >= 3 and parts[0] == "" and parts[1] in DEFINITION_SECTIONS:
        name = _unescape(parts[2])
        renamed = renames.get((parts[1], name))
        if renamed is not None:
            return "/".join(["#", "$defs", _escape(renamed), *parts[3:]])
    return "#" + pointer + ref[1:]


def _unescape(segment: str) -> str:
    return segment.replace("~1", "/").replace("~0", "~")


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
