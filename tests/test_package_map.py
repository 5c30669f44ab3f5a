"""The package map holds: ``lint-imports`` checks the contracts in pyproject.toml's
``[tool.importlinter]`` (the engine's floors, no import circles, kernels only through the
backend, the engine and the servers apart) over the source as it is, TYPE_CHECKING imports
included; and docs/architecture.md's table of the engine's floors is the contract's."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

from tandem.testing.processes import REPO_ROOT


def test_imports_follow_the_package_map() -> None:
    lint_imports = shutil.which("lint-imports")
    assert lint_imports is not None, "import-linter is a dev dependency: pip install -e '.[dev]'"
    result = subprocess.run(
        [lint_imports, "--no-cache"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_architecture_doc_names_the_contract_floors() -> None:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    (engine_floors,) = [
        contract["layers"]
        for contract in config["tool"]["importlinter"]["contracts"]
        if contract.get("containers") == ["engine"]
    ]
    contract = [{name.strip() for name in floor.split("|")} for floor in engine_floors]
    doc = (REPO_ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (.+?) \|", doc, flags=re.MULTILINE)
    documented = [
        {name.removesuffix("/").removesuffix(".py") for name in re.findall(r"`([^`]+)`", cell)}
        for _, cell in rows
    ]
    assert documented == contract
    assert len(contract) <= 10
