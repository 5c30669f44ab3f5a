"""The sampling defaults a Hugging Face checkpoint recommends in its generation_config.json."""

from __future__ import annotations

import json
import logging
from pathlib import Path

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
}


def read_sampling_defaults(directory: Path) -> SamplingDefaults:
    """The sampling fields of ``directory``'s generation_config.json (none without one); a
    value the engine could not use is left out, with a warning."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return SamplingDefaults()
    config = json.loads(path.read_text(encoding="utf-8"))
    values: dict[str, float | int] = {}
    for name, transformers_default in _TRANSFORMERS_DEFAULTS.items():
        value = config.get(name)
        if value is None or value == transformers_default:
            continue
        kind = int if name == "top_k" else float
        problem = (
            f"{name} must be a number"
            if isinstance(value, bool) or not isinstance(value, int | float)
            else SamplingParams(**{name: kind(value)}).validate()
        )
        if problem:
            logger.warning("%s: ignoring %s = %r: %s", path, name, value, problem)
            continue
        values[name] = kind(value)
    return SamplingDefaults(**values)
