"""GPU tests: skipped where CUDA is absent (CI), run on the GPU machine."""

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.testing.random_checkpoint import save_random_model


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shape_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A random bf16 checkpoint of a real model's shape (SHAPES, in
    tandem/testing/random_checkpoint.py), saved once a session, or found as ckpt-SHAPE
    under $TANDEM_CHECKPOINTS (where scripts/gpu_session.sh makes them)."""

    def checkpoint(shape: str) -> Path:
        made = Path(os.environ.get("TANDEM_CHECKPOINTS", "/nonexistent")) / f"ckpt-{shape}"
        if (made / "config.json").exists():
            return made
        directory = tmp_path_factory.getbasetemp() / f"shape-{shape}"
        if not (directory / "config.json").exists():
            save_random_model(directory, shape, torch.bfloat16)
        return directory

    return checkpoint
