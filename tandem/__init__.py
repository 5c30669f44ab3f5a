"""Tandem's tools: the ``tandem`` command (``tandem/cli.py``) and what it runs.

- ``tandem serve``: engine replicas and HTTP servers, supervised (``tandem/supervisor.py``);
- ``tandem bench NAME``: the benchmarks (``tandem/bench/``);
- ``tandem.testing``: random checkpoints, processes and references that the tests, the
  benchmarks and the scripts in scripts/ share (it needs the dev dependencies).

The engine, the servers and protocol import nothing from here (pyproject's package map).
"""
