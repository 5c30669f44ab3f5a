"""What a step costs, measured by the engine itself: the seconds of a plain decode step, of a
verify step, of one draft pass of the proposer, and what a probe (one verify step between
plain ones) costs beyond the plain steps it replaces, by batch size, for the adaptive policy
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

Why the host's clock sees the device's work without a synchronization of its own: a step
launched on an asynchronous device (CUDA) is waited for by the step after it, which reads its
tokens, so in a run of steps of one kind each period holds one step's device time, whichever
period the wait falls in. The proposer's time holds its device time for the same reason: it
returns its drafts in host memory (``Proposer.propose``), so a draft model's passes are done
when it returns (its one copy of the drafts waits for them). At a change of kind the wait
falls in the step after the change; so a probe, a verify step between plain steps, is timed
with the step after it: from its start to that step's end, less the two plain steps they
stand for. It holds what a probe adds: a draft model's catch-up over the tokens of the pause
(op by op, not a graph), the overlap both steps lose, the verify step's own cost.

A plain step is what drafting must beat, so it is never inferred: until a batch size has it
measured, the policy drafts for no one there (``knows_plain``: the periods of three plain
steps that each followed one, the estimate starting at their least, falling faster than it
rises; one again after ``FIRST_PLAIN_REFRESH_STEPS`` verify steps there, then twice as many
each time up to ``PLAIN_REFRESH_STEPS``). (Inferred from a verify step and the graphs'
device times, as before, a host-bound plain step came out at twice its cost, and a draft as
costly as the target's own pass seemed to pay.) A verify step or a draft pass counts once
measured three times, also from their least: one slow step must not stop drafting for good.
Until then they cost as at the nearest batch size where they were measured, in proportion to
the plain steps (learnt once, not again at every size); where none was, a verify step costs
as a plain step, and a draft pass its device time (``seed``: at start-up on CUDA the engine
times a replay of each decode and draft graph) scaled by the host's share as the plain
step's device time is to its cost, or, unseeded (the CPU), the proposer's prior (a draft
model's pass as a plain step; prompt lookup nothing): estimates no higher than the costs,
since one too low leads to the verify steps that measure it, one too high to none.

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
# A plain step's measurement below its estimate weighs this much: the estimate falls quickly to
# a faster host (its first steps, while the engine warms, are slow) and rises slowly. An
# estimate too high makes drafting that does not pay seem to pay; one too low only holds
# back drafting that pays little.
PLAIN_FALL_WEIGHT = 1 / 2
# A measurement more than this many times the estimate is taken as this many times it: a
# garbage collection or the caller's pause is not the step's cost.
MOST_OVER_ESTIMATE = 4.0
# An estimate starts as the least of its first few measurements: a step's time has a floor and
# only upward outliers (the first steps after a prompt, a collection), and one such as the
# first plain step would make drafting seem to pay until plain steps were measured again.
FIRST_MEASUREMENTS = 3
# A batch size's plain step is measured again after this many verify steps there: drafting
# that pays runs no plain steps, and the host's pace drifts. If this many steps then pass
# without two plain ones in a row (prompts arriving all the time), the old estimate stands.
# The first time after FIRST_PLAIN_REFRESH_STEPS, each time after twice as many, up to
# PLAIN_REFRESH_STEPS: an estimate from an engine's first steps, slower than its later
# ones, made the target as its own draft seem to pay for the whole of a short run.
FIRST_PLAIN_REFRESH_STEPS = 16
PLAIN_REFRESH_STEPS = 512
REFRESH_PATIENCE = 8

PLAIN, VERIFY, DRAFT_PASS, PROBE = range(4)
# A step's kind when it read the step before it early to propose, and verifies nothing (the
# proposer found nothing, or a draft model only caught up): a probe's cost all the same.
PROPOSED_NOTHING = -1


@dataclass
class _Step:
    started: float
    kind: int  # 1: a plain decode step; q > 1: a verify step of q tokens a row;
    # PROPOSED_NOTHING; 0: other
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
    probe: float  # a probe's cost beyond the plain steps it replaces


class StepCosts:
    def __init__(self, draft_pass_prior: float) -> None:
        """``draft_pass_prior``: a draft's cost before any was measured or seeded, in plain
        steps (1 for a draft model, whose pass is a forward pass as a plain step is; 0 for
        prompt lookup, a search on the host)."""
        self.draft_pass_prior = draft_pass_prior
        size = len(CAPTURE_BATCH_SIZES)
        self.measured = [[math.nan] * size for _ in range(4)]
        self.counts = [[0] * size for _ in range(4)]
        self.since_plain = [0] * size  # verify steps at each batch size since a plain one
        # After how many of them the plain step there is measured again.
        self.refresh_after = [FIRST_PLAIN_REFRESH_STEPS] * size
        self.seeded = [[math.nan] * size for _ in range(3)]
        # The batch sizes where plain and verify steps and draft passes were all measured.
        self.fully_measured: list[int] = []
        # What the probes measured since ``take_probe_seconds`` was last called cost.
        self.probe_seconds = 0.0
        # The last three steps, the newest last; steps before the first are "other" (0).
        self._steps = [_Step(0.0, 0, -1, 0.0, 0) for _ in range(3)]

    @staticmethod
    def bucket(batch_size: int) -> int:
        return min(bisect_left(CAPTURE_BATCH_SIZES, batch_size), len(CAPTURE_BATCH_SIZES) - 1)

    def seed(self, decode_graphs: StepGraphs | None, draft_pass_graphs: StepGraphs | None) -> None:
        """The device's times of the graphs' replays, at each size they were captured at."""
        for kind, graphs in ((PLAIN, decode_graphs), (DRAFT_PASS, draft_pass_graphs)):
            if graphs is not None:
                for size, seconds in graphs.replay_seconds().items():
                    self.seeded[kind][self.bucket(size)] = seconds

    def observe(
        self, started: float, kind: int, batch_size: int, propose_seconds: float, width: int
    ) -> None:
        """A step started at ``started`` (``time.perf_counter``): ``kind`` 1 for a plain
        decode step, q for a verify step of q tokens a row, ``PROPOSED_NOTHING`` for a step
        that proposed and verified nothing, 0 for any other (a prompt's); the proposer took
        ``propose_seconds`` for ``width`` drafts a row at most. Measures the step before it,
        and a probe two steps before it."""
        older, previous, last = self._steps
        if last.kind > 0 and last.kind == previous.kind and last.bucket == previous.bucket:
            period = started - last.started
            if last.kind == 1:
                self._add(PLAIN, last.bucket, period)
                if self.since_plain[last.bucket] >= self.refresh_after[last.bucket]:
                    self.refresh_after[last.bucket] = min(
                        2 * self.refresh_after[last.bucket], PLAIN_REFRESH_STEPS
                    )
                self.since_plain[last.bucket] = 0
            else:
                self._add(VERIFY, last.bucket, period - last.propose_seconds)
                self._add(DRAFT_PASS, last.bucket, last.propose_seconds / max(last.width, 1))
        plain = self.measured[PLAIN][last.bucket]
        if (
            (previous.kind > 1 or previous.kind == PROPOSED_NOTHING)
            and older.kind == 1
            and last.kind == 1
            and older.bucket == previous.bucket == last.bucket
            and not math.isnan(plain)
        ):
            # A probe between plain steps (verifying drafts or not: its proposer ran): its
            # wait falls in the step after it.
            excess = max(started - previous.started - 2 * plain, 0.0)
            self._add(PROBE, last.bucket, excess)
            self.probe_seconds += excess
        bucket = self.bucket(batch_size)
        refresh_after = self.refresh_after[bucket]
        if kind > 1 or self.since_plain[bucket] >= refresh_after:
            self.since_plain[bucket] += 1
            if self.since_plain[bucket] >= refresh_after + REFRESH_PATIENCE:
                self.since_plain[bucket] = 0
        self._steps = [
            previous,
            last,
            _Step(started, kind, self.bucket(batch_size), propose_seconds, width),
        ]

    def _add(self, kind: int, bucket: int, seconds: float) -> None:
        estimates = self.measured[kind]
        old = estimates[bucket]
        count = self.counts[kind][bucket]
        self.counts[kind][bucket] = count + 1
        if bucket not in self.fully_measured and all(
            self.counts[measured][bucket] >= FIRST_MEASUREMENTS
            for measured in (PLAIN, VERIFY, DRAFT_PASS)
        ):
            self.fully_measured.append(bucket)
        if math.isnan(old):
            estimates[bucket] = seconds
        elif count < FIRST_MEASUREMENTS and kind != PROBE:
            estimates[bucket] = min(old, seconds)
        else:
            seconds = min(seconds, MOST_OVER_ESTIMATE * old)
            weight = PLAIN_FALL_WEIGHT if kind == PLAIN and seconds < old else NEW_WEIGHT
            estimates[bucket] = old + weight * (seconds - old)

    def take_probe_seconds(self) -> float:
        """The seconds the probes measured since the last call cost beyond plain steps."""
        seconds, self.probe_seconds = self.probe_seconds, 0.0
        return seconds

    def knows_plain(self, batch_size: int) -> bool:
        """Whether a plain step at ``batch_size`` was measured (``FIRST_MEASUREMENTS`` times)
        and lately: what drafting must beat."""
        bucket = self.bucket(batch_size)
        return (
            self.counts[PLAIN][bucket] >= FIRST_MEASUREMENTS
            and self.since_plain[bucket] < self.refresh_after[bucket]
        )

    def _nearest_measured(self, bucket: int) -> int | None:
        """The batch size nearest ``bucket`` where plain and verify steps and draft passes
        were all measured (``FIRST_MEASUREMENTS`` times each); None if none."""
        return min(self.fully_measured, key=lambda other: abs(other - bucket), default=None)

    def costs(self, batch_size: int) -> Costs:
        """The estimates at ``batch_size``: each kind measured where measured (verify steps
        and draft passes ``FIRST_MEASUREMENTS`` times); else from the seeds and the prior, as
        the module says; before a plain step is measured, the seeds (device times) or 1
        (``knows_plain`` says which)."""
        bucket = self.bucket(batch_size)
        plain, verify, draft_pass, probe = (
            # A verify step or draft pass counts once measured its first few times: until
            # then the lower estimates below lead to more of them.
            estimates[bucket]
            if kind in (PLAIN, PROBE) or counts[bucket] >= FIRST_MEASUREMENTS
            else math.nan
            for kind, (estimates, counts) in enumerate(zip(self.measured, self.counts, strict=True))
        )
        seeds = [estimates[bucket] for estimates in self.seeded]
        if math.isnan(plain):
            plain = 1.0 if math.isnan(seeds[PLAIN]) else seeds[PLAIN]
        elif math.isnan(verify) or math.isnan(draft_pass):
            # Not measured at this batch size: as at the nearest one where they were, in
            # proportion to the plain steps (the host's share and the draft's cost against
            # the target's change little from one size to the next), so that what was learnt
            # at one size is not learnt again with verify steps at every other.
            near = self._nearest_measured(bucket)
            if near is not None:
                scale = plain / self.measured[PLAIN][near]
                if math.isnan(verify):
                    verify = self.measured[VERIFY][near] * scale
                if math.isnan(draft_pass):
                    draft_pass = self.measured[DRAFT_PASS][near] * scale
        if math.isnan(verify):
            # As cheap as a plain step until measured: a low estimate leads to the verify
            # steps that measure it, a high one to none. (Estimated from the verify graphs'
            # device times at start-up, scaled by the plain step's or added to it, it came out
            # several times a verify step's real cost, and nothing was drafted.)
            verify = plain
        if math.isnan(draft_pass):
            # The device's time, scaled as the plain step's device time is to its measured
            # cost (the host's share, where the host sets the pace), never down: a pass costs
            # at least that, since the proposer waits for its drafts with the host in the
            # loop, where a plain step overlaps the host's work with the device's. A low
            # estimate is corrected by the verify steps it leads to, a high one never;
            # unscaled, a draft as costly as the target seemed to pay with every draft
            # accepted, and drafted at batch sizes not yet measured.
            draft_pass = seeds[DRAFT_PASS] * max(1.0, plain / seeds[PLAIN])
            if math.isnan(draft_pass):
                draft_pass = self.draft_pass_prior * plain
        if math.isnan(probe):
            # Until one is measured: its verify step and one draft over the plain step.
            probe = max(verify + draft_pass - plain, 0.0)
        return Costs(plain, verify, draft_pass, probe)
