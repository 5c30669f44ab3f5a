"""The package map holds: ``lint-imports`` checks the contracts in pyproject.toml's
``[tool.importlinter]`` (the engine's floors, no import circles, the engine and the servers
apart) over the source as it is, TYPE_CHECKING imports included."""

from __future__ import annotations

import shutil
import subprocess

from tandem.testing.processes import REPO_ROOT


def test_imports_follow_the_package_map() -> None:
    lint_imports = shutil.which("lint-imports")
    assert lint_imports is not None, "import-linter is a dev dependency: pip install -e '.[dev]'"
    result = subprocess.run(
        [lint_imports, "--no-cache"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
