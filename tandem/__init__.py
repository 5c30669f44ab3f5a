"""Tandem's tools: the ``tandem`` command (``tandem/cli.py``) and what it runs.

- ``tandem serve``: engine replicas and HTTP servers, supervised (``tandem/supervisor.py``);
- ``tandem bench NAME``: the benchmarks (``tandem/bench/``);
- ``tandem.testing``: random checkpoints, processes and references that the tests, the
  benchmarks and the scripts in scripts/ share (it needs the dev dependencies).

The engine, the servers and protocol import nothing from here (pyproject's package map).
"""

from pathlib import Path

# The checkout this package runs from (installed editable, as the README sets it up): the
# supervisor's children start there, and the tools read its files (scripts/data/, the tree).
REPO_ROOT = Path(__file__).resolve().parent.parent
