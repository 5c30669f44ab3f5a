"""The sampling defaults a Hugging Face checkpoint recommends in its generation_config.json."""

from __future__ import annotations

import logging
from pathlib import Path

from engine.checkpoint.hf_config import read_json_object
from protocol import SamplingDefaults, SamplingParams

logger = logging.getLogger("engine.checkpoint")

# The fields read, with transformers' own defaults: like vLLM (which reads the file through
# GenerationConfig.to_diff_dict), a value equal to transformers' default is no recommendation.
_TRANSFORMERS_DEFAULTS: dict[str, float | int | None] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
    "max_new_tokens": None,
}
# generation_config.json's names for SamplingDefaults' fields, where they differ.
_DEFAULT_NAMES = {"max_new_tokens": "max_tokens"}


def read_sampling_defaults(directory: Path) -> SamplingDefaults:
    """The sampling fields of ``directory``'s generation_config.json (none without one); a
    value the engine could not use is left out, with a warning."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return SamplingDefaults()
    config = read_json_object(path)
    values: dict[str, float | int] = {}
    for name, transformers_default in _TRANSFORMERS_DEFAULTS.items():
        value = config.get(name)
        if value is None or value == transformers_default:
            continue
        field = _DEFAULT_NAMES.get(name, name)
        kind = int if field in ("top_k", "max_tokens") else float
        problem = (
            f"{name} must be a number"
            if isinstance(value, bool) or not isinstance(value, int | float)
            else SamplingParams(**{field: kind(value)}).validate()
        )
        if problem:
            logger.warning("%s: ignoring %s = %r: %s", path, name, value, problem)
            continue
        values[field] = kind(value)
    return SamplingDefaults(**values)
