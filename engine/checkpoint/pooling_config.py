"""How a checkpoint pools its hidden states into an embedding (/v1/embeddings), as vLLM reads
it: a sentence-transformers model's Pooling module (modules.json names its folder, whose
config.json sets one ``pooling_mode_*``), else the last token's, vLLM's default for a causal
language model."""

from __future__ import annotations

import logging
from pathlib import Path

from engine.checkpoint.hf_config import ConfigValues, read_json, read_json_object, shown

logger = logging.getLogger("engine.checkpoint")

LAST, MEAN, CLS = "last", "mean", "cls"
# sentence-transformers' pooling_mode_* flags, by the pooling each one is.
_MODES = {
    "pooling_mode_lasttoken": LAST,
    "pooling_mode_mean_tokens": MEAN,
    "pooling_mode_cls_token": CLS,
}
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_MODULES = "modules.json"


def read_pooling(directory: Path) -> str:
    """LAST, MEAN or CLS: what ``directory``'s sentence-transformers config says, else LAST.
    A mode this engine does not pool by (max, weighted mean) is warned about and LAST used."""
    modules_path = directory / _MODULES
    if not modules_path.is_file():
        return LAST
    # Every module's type and folder are read, the Pooling module's or not: a file of the
    # wrong shape is refused whichever module holds the fault.
    modules = [
        (module.name("type", ""), module.name("path", ""))
        for module in _modules(directory, read_json(modules_path))
    ]
    folders = [folder for kind, folder in modules if kind == _POOLING_MODULE]
    config_path = directory / folders[0] / "config.json" if folders else None
    if config_path is None or not config_path.is_file():
        return LAST
    config = read_json_object(config_path)
    chosen = [pooling for mode, pooling in _MODES.items() if config.get(mode)]
    if len(chosen) == 1:
        return chosen[0]
    logger.warning(
        "%s: pooling %s is not served; embeddings pool the last token",
        config_path,
        {key: value for key, value in config.items() if key.startswith("pooling_mode")},
    )
    return LAST


def _modules(directory: Path, modules: object) -> list[ConfigValues]:
    """modules.json's entries, a list of JSON objects as sentence-transformers writes it
    ({"idx": 1, "name": "1", "path": "1_Pooling", "type": "..."}); another shape is refused by
    name."""
    if not isinstance(modules, list):
        raise ValueError(
            f"{directory / _MODULES}: expected a JSON array of modules, not "
            f"{type(modules).__name__}"
        )
    for number, module in enumerate(modules):
        if not isinstance(module, dict):
            raise ValueError(
                f"{directory / _MODULES}: module {number} is {shown(module)}, not a JSON object"
            )
    return [
        ConfigValues(module, directory, f"module {number}", _MODULES)
        for number, module in enumerate(modules)
    ]
