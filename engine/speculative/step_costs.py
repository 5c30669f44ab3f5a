"""What a step costs, measured by the engine itself: the seconds of a plain decode step, of a
verify step and of one draft pass of the proposer, by batch size, for the adaptive policy
(``adaptive.py``) to weigh speculation against plain decoding.

Measured, not modelled, because what a step costs here is mostly not arithmetic: a small
model's batch-1 step is the host's work (7% of its roofline), a plain step overlaps the
host's work with the device's while a verify step cannot (proposing needs the tokens of the
step before it), and a large batch of a large model is bound by its products. The roofline
(``engine/roofline.py``) sees only the last of these. So each step's time is taken from the
engine's own clock: a step's cost is the time from its start to the next step's start, the
host's work, the caller's and any wait for the device included. Only a step that follows
one of its own kind and batch size counts (the steady state: a plain step after a verify
step waited for it, and the first verify step after plain ones waited for a plain step).
For a verify step the proposer's time is taken apart: its draft passes cost per draft (a
draft model's k passes), the rest once a step. The estimates are running averages, each
new step weighing 1/8, so that they follow the host's pace.

Until a batch size has its measurements, the device's times seed it: at start-up on CUDA
the engine times a replay of each decode, verify and draft graph (``seed``). They leave the
host out, so only their ratio is used where the other kind was measured. Before anything is
measured or seeded (the CPU), a verify step costs as a plain step and a draft the proposer's
prior (a draft model's pass as a plain step; prompt lookup nothing): the first verify steps
then measure them.

Batch sizes are grouped as the CUDA graphs' ladder groups them (a batch runs as the next
captured size).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass

from engine.execution.cuda_graphs import CAPTURE_BATCH_SIZES, StepGraphs

# Each new measurement's weight in the running average.
NEW_WEIGHT = 1 / 8
# A measurement more than this many times the estimate is taken as this many times it: a
# garbage collection or the caller's pause is not the step's cost.
MOST_OVER_ESTIMATE = 4.0

PLAIN, VERIFY, DRAFT_PASS = range(3)


@dataclass
class _Step:
    started: float
    kind: int  # 1: a plain decode step; q > 1: a verify step of q tokens a row; 0: other
    bucket: int
    propose_seconds: float
    width: int  # the most drafts of a row


@dataclass
class Costs:
    """One batch size's estimates, in seconds (or in the plain step's units where nothing
    was measured or seeded: then both steps cost 1)."""

    plain: float
    verify: float  # a verify step, its proposer's passes apart
    draft_pass: float  # the proposer's time per draft


class StepCosts:
    def __init__(self, draft_pass_prior: float) -> None:
        """``draft_pass_prior``: a draft's cost before any was measured or seeded, in plain
        steps (1 for a draft model, whose pass is a forward pass as a plain step is; 0 for
        prompt lookup, a search on the host)."""
        self.draft_pass_prior = draft_pass_prior
        size = len(CAPTURE_BATCH_SIZES)
        self.measured = [[math.nan] * size for _ in range(3)]
        self.seeded = [[math.nan] * size for _ in range(3)]
        self._last: _Step | None = None
        self._kind_before_last = 0
        self._bucket_before_last = -1

    @staticmethod
    def bucket(batch_size: int) -> int:
        return min(bisect_left(CAPTURE_BATCH_SIZES, batch_size), len(CAPTURE_BATCH_SIZES) - 1)

    def seed(
        self,
        decode_graphs: StepGraphs | None,
        verify_graphs: StepGraphs | None,
        draft_pass_graphs: StepGraphs | None,
    ) -> None:
        """The device's times of the graphs' replays, at each size they were captured at."""
        for kind, graphs in (
            (PLAIN, decode_graphs),
            (VERIFY, verify_graphs),
            (DRAFT_PASS, draft_pass_graphs),
        ):
            if graphs is not None:
                for size, seconds in graphs.replay_seconds().items():
                    self.seeded[kind][self.bucket(size)] = seconds

    def observe(
        self, started: float, kind: int, batch_size: int, propose_seconds: float, width: int
    ) -> None:
        """A step started at ``started`` (``time.perf_counter``): ``kind`` 1 for a plain
        decode step, q for a verify step of q tokens a row, 0 for any other (a prompt's, a
        step that proposed and verified nothing); the proposer took ``propose_seconds`` for
        ``width`` drafts a row at most. Measures the step before it."""
        last = self._last
        if (
            last is not None
            and last.kind
            and last.kind == self._kind_before_last
            and last.bucket == self._bucket_before_last
        ):
            period = started - last.started
            if last.kind == 1:
                self._add(PLAIN, last.bucket, period)
            else:
                self._add(VERIFY, last.bucket, period - last.propose_seconds)
                self._add(DRAFT_PASS, last.bucket, last.propose_seconds / max(last.width, 1))
        if last is not None:
            self._kind_before_last, self._bucket_before_last = last.kind, last.bucket
        self._last = _Step(started, kind, self.bucket(batch_size), propose_seconds, width)

    def _add(self, kind: int, bucket: int, seconds: float) -> None:
        estimates = self.measured[kind]
        old = estimates[bucket]
        if math.isnan(old):
            estimates[bucket] = seconds
        else:
            seconds = min(seconds, MOST_OVER_ESTIMATE * old)
            estimates[bucket] = old + NEW_WEIGHT * (seconds - old)

    def costs(self, batch_size: int) -> Costs:
        """The estimates at ``batch_size``: measured where measured; else, for one kind of
        step, the other's measurement times the seeds' ratio; else the seeds; else equal."""
        bucket = self.bucket(batch_size)
        plain, verify, draft_pass = (estimates[bucket] for estimates in self.measured)
        seeds = [estimates[bucket] for estimates in self.seeded]
        ratio = seeds[VERIFY] / seeds[PLAIN]  # nan unless both were seeded
        if math.isnan(ratio):
            ratio = 1.0
        if math.isnan(plain) and math.isnan(verify):
            plain, verify = (1.0, 1.0) if math.isnan(seeds[VERIFY]) else seeds[:2]
        elif math.isnan(plain):
            plain = verify / ratio
        elif math.isnan(verify):
            verify = plain * ratio
        if math.isnan(draft_pass):
            draft_pass = seeds[DRAFT_PASS]
            if math.isnan(draft_pass):
                draft_pass = self.draft_pass_prior * plain
        return Costs(plain, verify, draft_pass)
