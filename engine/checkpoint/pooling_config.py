"""How a checkpoint pools its hidden states into an embedding (/v1/embeddings), as vLLM reads
it: a sentence-transformers model's Pooling module (modules.json names its folder, whose
config.json sets one ``pooling_mode_*``), else the last token's, vLLM's default for a causal
language model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger("engine.checkpoint")

LAST, MEAN, CLS = "last", "mean", "cls"
# sentence-transformers' pooling_mode_* flags, by the pooling each one is.
_MODES = {
    "pooling_mode_lasttoken": LAST,
    "pooling_mode_mean_tokens": MEAN,
    "pooling_mode_cls_token": CLS,
}
_POOLING_MODULE = "sentence_transformers.models.Pooling"


def read_pooling(directory: Path) -> str:
    """LAST, MEAN or CLS: what ``directory``'s sentence-transformers config says, else LAST.
    A mode this engine does not pool by (max, weighted mean) is warned about and LAST used."""
    modules_path = directory / "modules.json"
    if not modules_path.is_file():
        return LAST
    modules = json.loads(modules_path.read_text())
    folders = [m.get("path", "") for m in modules if m.get("type") == _POOLING_MODULE]
    config_path = directory / folders[0] / "config.json" if folders else None
    if config_path is None or not config_path.is_file():
        return LAST
    config = json.loads(config_path.read_text())
    chosen = [pooling for mode, pooling in _MODES.items() if config.get(mode)]
    if len(chosen) == 1:
        return chosen[0]
    logger.warning(
        "%s: pooling %s is not served; embeddings pool the last token",
        config_path,
        {key: value for key, value in config.items() if key.startswith("pooling_mode")},
    )
    return LAST
