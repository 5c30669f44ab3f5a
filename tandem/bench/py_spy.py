"""Where a running process's CPU goes: py-spy samples it while a benchmark runs, and the
samples are summed by function.

py-spy samples from outside the process, so the process runs as it would unprofiled. Only the
thread holding the GIL is sampled (``--gil``): a Python server's idle threads (a thread pool's
workers waiting for work) would otherwise count as busy, and its event loop's waits in
``epoll`` too. The raw output (one line per distinct stack: ``frame;frame;... count``) is kept
for flame graphs (flamegraph.pl, speedscope).
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import TracebackType

# Samples a second: enough to see a function worth 1% in a run of seconds, little overhead.
_RATE = 200
# A frame as py-spy writes it, "function (file:line)": the line is dropped to sum by function.
_LINE = re.compile(r":\d+\)$")


def py_spy_command() -> str:
    """py-spy from this Python's environment (the dev extra installs it), else from PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy)")
    return found


class Recording:
    """py-spy recording process ``pid`` into ``path`` (raw stacks) from entry to exit."""

    def __init__(self, pid: int, path: Path) -> None:
        self.path = path
        command = [py_spy_command(), "record", "--pid", str(pid), "--gil", "--format", "raw"]
        command += ["--rate", str(_RATE), "--output", str(path)]
        self._log = path.with_suffix(".log")
        self._process: subprocess.Popen | None = None
        self._command = command

    def __enter__(self) -> Recording:
        with open(self._log, "wb") as log:
            self._process = subprocess.Popen(self._command, stdout=log, stderr=subprocess.STDOUT)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        assert self._process is not None
        # SIGINT, as Ctrl-C: py-spy writes what it sampled, then exits.
        self._process.send_signal(signal.SIGINT)
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if not self.path.exists():
            raise RuntimeError(f"py-spy wrote no profile: {self._log.read_text()[-2000:]}")


def self_time_by_function(paths: list[Path]) -> tuple[Counter[str], int]:
    """Each function's samples at the top of the stack (its own time, not its callees'),
    summed over the files, and the number of samples."""
    functions: Counter[str] = Counter()
    total = 0
    for path in paths:
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            samples = int(count)
            total += samples
            functions[_LINE.sub(")", stack.rsplit(";", 1)[-1])] += samples
    return functions, total


def print_top_functions(paths: list[Path], count: int = 15) -> None:
    """The ``count`` functions with the most own time in ``paths``' samples, as shares."""
    functions, total = self_time_by_function(paths)
    print(f"  where the servers' CPU went ({total} samples; py-spy, own time by function):")
    for function, samples in functions.most_common(count):
        print(f"  {samples / max(total, 1):6.1%}  {function}")
