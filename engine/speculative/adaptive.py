"""Speculation that adapts (``--speculative-adaptive``, the default): each step, how many
tokens to draft (k, the step's width), for whom, and whether to draft at all, from each
request's measured acceptance and the measured cost of the steps.

The model. A request whose drafts are each accepted with probability alpha once those before
them were emits E(alpha, k) = 1 + alpha + ... + alpha^k tokens from a verify step of k drafts
(the usual model of speculative decoding), one from a plain step. A step of B requests that
drafts up to k tokens for some of them costs ``verify + k * draft_pass`` seconds and emits
B + sum(E_i(k) - 1) tokens; a plain step costs ``plain`` and emits B. The costs are
``step_costs.py``'s, measured at the batch size; alpha is each request's own estimate
(``engine/scheduling/draft_acceptance.py``) for the source its drafts come from (the n-gram's
length: a request that copies its input gets long matches accepted, chance short ones
rejected), its prior the engine's estimate for that source (a new request starts from what
the others measured). The policy takes the k of most tokens a second and drafts if that
beats plain decoding, so:

- k follows acceptance where drafts cost per token: a draft model's passes (k of them), and
  each step's measured cost; where the verify step is a CUDA graph of 1 + k tokens a row
  (every width costs the same) and the n-gram lookup is nearly free, k is the most the
  lookup finds, up to ``--num-speculative-tokens``;
- at batch sizes where a verify step costs more (a large batch of a large model is bound by
  its products, which grow with the 1 + k tokens a row), drafting stops unless the drafts
  make up for it: the batch's size and tokens are in the measured cost;
- drafting stops for requests whose drafts do not pay (k = 0): they pause
  (``engine/scheduling/draft_pause.py``: 4 steps, twice as long each time, up to 64, short
  again once drafting pays), and a paused request decodes as it would without speculation.
  The step in flight is read early only when someone drafts, so a batch that drafts for no
  one overlaps its steps as plain decoding does;
- nothing is drafted at a batch size until a plain step was measured there (the plain steps
  of ``StepCosts.knows_plain``): the plain step is what drafting must beat, and one inferred
  from other steps made a draft as costly as the target itself seem to pay;
- after a pause a request's drafting is weighed again. Where the proposer can tell from the
  tokens the host has what it would draft from (``Proposer.preview``: prompt lookup's n-gram
  length), it is weighed by the acceptance the engine measured for that source (the
  request's own counts are of text before its pause), and paused again at the cost of a
  lookup when it would not pay: text that starts repeating itself is found when the pause
  ends, and no verify step is spent where nothing repeats. Where it cannot
  (a draft model), the request probes: it drafts once whatever the estimates. A probe costs
  beyond the plain steps it replaces (``step_costs.py`` measures it: a draft model's
  catch-up over the pause's tokens, the lost overlap), so probes wait until the plain steps
  since the last one earned it: they take at most ``PROBE_SHARE`` of the time (each charged
  what it was measured to cost once it is), and the requests due then probe together, one
  verify step for the batch. Each probe halves that share for the next, down to
  ``LEAST_PROBE_SHARE``, and a draft accepted anywhere (a probe's or drafting's) restores it:
  a draft that guesses nothing costs a quarter of a percent once a few probes found nothing,
  where it cost 2%, and text it starts to guess is found by the next probe (at the least
  share, once plain steps have run 400 times a probe's cost), then probed for at the full
  share. Requests due ride along, free, where others' drafts pay. Where not even drafts all
  accepted would win back a probe's measured cost within a longest pause's steps of drafting
  (a draft whose pass costs about as much as the target's: the target as its own draft,
  whose verify steps a large model's batch-1 step never times since no two come in a row),
  there is nothing a probe could find that pays for it: the requests pause again instead,
  and such a draft costs nothing once its costs are measured.

Two decisions a step: before the step in flight is read (``plan``: who may draft, and k, from
the estimates for each request's latest source), and once the drafts are proposed
(``choose``: the same rule with the sources the drafts came from; a step whose drafts no
longer pay verifies none). Work per step: one pass over the drafting requests, and numpy over
a [requests, k] table.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from engine.scheduling.draft_acceptance import DraftAcceptance
from engine.scheduling.draft_pause import LONGEST_PAUSE
from engine.scheduling.request import Request
from engine.speculative.step_costs import StepCosts

# The prior of the engine's own estimates, before any draft was verified: an even chance.
FIRST_PRIOR = 0.5
# The engine's counts keep 0.98 of their weight a verify step: they describe how good a
# source is for this model and workload, which changes slowly.
ENGINE_MEMORY = 0.98
# The lookups of requests waiting for something to draft from (``Proposer.preview``) take at
# most this share of the time.
LOOKUP_SHARE = 0.05
# Probes whose drafts the proposer cannot preview (a draft model's) take at most this share of
# the time while drafts are accepted; each probe halves it for the next, down to the least,
# until a draft is accepted again: all that a draft that guesses nothing costs for long.
PROBE_SHARE = 0.02
LEAST_PROBE_SHARE = PROBE_SHARE / 8


class AdaptiveDrafting:
    def __init__(
        self,
        max_drafts: int,
        costs: StepCosts,
        max_batch: int | None,
        preview: Callable[[Request], int | None] | None = None,
    ) -> None:
        """Drafts at most ``max_drafts`` tokens a request; no drafting at batches over
        ``max_batch`` (the largest verify step a CUDA graph runs: an eager one costs many
        times a plain step; None: no such limit). ``preview``: the proposer's
        (``Proposer.preview``), the source a request's drafts would come from by the tokens
        the host has (0: none), None where it cannot tell."""
        self.max_drafts = max_drafts
        self.costs = costs
        self.max_batch = max_batch
        self.preview = preview
        # Seconds of probing that plain steps earned (``probe_share`` of theirs) and probes
        # did not spend; below 0 when probes cost more than foreseen.
        self.probe_credit = 0.0
        self.probe_share = PROBE_SHARE
        # What the probes launched but not yet measured were foreseen to cost.
        self.probes_foreseen = 0.0
        self.engine_acceptance = DraftAcceptance(memory=ENGINE_MEMORY)
        self.widths = np.arange(1, max_drafts + 1)
        # A preview's seconds (a running average of the lookups timed in ``plan``).
        self.preview_seconds = 0.0

    def plan(self, candidates: list[Request], batch_size: int) -> tuple[list[Request], int]:
        """Before the step in flight is read: of ``candidates`` (the running requests that
        may be drafted for, in a batch of ``batch_size``), those to draft for this step and
        the most drafts a request; none (and 0) to draft for no one. Pauses count this step;
        requests drafting would not pay for are paused."""
        if self.max_batch is not None and batch_size > self.max_batch:
            return [], 0
        if not self.costs.knows_plain(batch_size):
            return [], 0  # plain steps first: they measure what drafting must beat
        active: list[Request] = []
        due: list[Request] = []  # their pause ended: a probe, unless a preview decides
        waiting: list[Request] = []  # nothing to draft from, in the preview
        previews_started = time.perf_counter()
        num_previews = 0
        for request in candidates:
            pause = request.draft_pause
            if not pause.may_draft():
                continue
            if not pause.probing:
                active.append(request)
                continue
            key = None if self.preview is None else self.preview(request)
            num_previews += key is not None
            if key is None:
                due.append(request)
            elif key:  # its drafts' source is known: weighed as any other's, by what the
                # engine measured for it (its own counts are older than its pause)
                request.draft_acceptance.forget()
                request.draft_acceptance.key = key
                pause.probing = False
                active.append(request)
            else:  # nothing to draft from: it looks again in a few steps
                waiting.append(request)
        if num_previews:
            seconds = (time.perf_counter() - previews_started) / num_previews
            self.preview_seconds += (seconds - self.preview_seconds) / 8
        self._wait(waiting, batch_size)
        spent = self.costs.take_probe_seconds()
        if spent:  # probes measured: charge what they cost, not what was foreseen
            self.probe_credit += self.probes_foreseen - spent
            self.probes_foreseen = 0.0
        costs = self.costs.costs(batch_size)
        if active:
            alphas = [self._alpha(r, r.draft_acceptance.key) for r in active + due]
            width, tokens = self._best_width(np.asarray(alphas), batch_size)
            # Their drafts pay (those due ride along): a later pause starts short.
            if tokens > batch_size:
                for request in active + due:
                    request.draft_pause.reset()
                    request.draft_pause.probing = False  # choose weighs them as the others
                return active + due, width
            for request in active:
                request.draft_pause.pause()
        if due and self.probe_credit >= costs.probe:
            if self._probe_could_repay(len(due), batch_size):
                self.probe_credit -= costs.probe
                self.probes_foreseen += costs.probe
                # The next probe waits twice as long, unless a draft is accepted before it.
                self.probe_share = max(self.probe_share / 2, LEAST_PROBE_SHARE)
                alphas = [self._alpha(r, r.draft_acceptance.key) for r in due]
                width, _ = self._best_width(np.asarray(alphas), batch_size)
                return due, width
            # Not even drafts all accepted would win the probe back (a draft about as costly
            # as the target's own pass): a probe could show nothing that pays for it.
            for request in due:
                request.draft_pause.pause()
        # A plain step: it earns the probes their share of its time (a probe at most
        # banked, so that probes after a long run of drafting do not come in a burst; a
        # debt, when a probe cost more than foreseen, is paid off first).
        self.probe_credit = min(self.probe_credit + self.probe_share * costs.plain, costs.probe)
        return [], 0

    def choose(
        self,
        requests: list[Request],
        drafts: list[list[int]],
        keys: list[int],
        batch_size: int,
        width: int,
    ) -> list[list[int]]:
        """Once proposed (``drafts[i]`` for ``requests[i]``, from source ``keys[i]``, up to
        ``width`` each): the drafts to verify. All of them if their expected tokens pay for
        the verify step (or a request probes); else none, and the requests pause."""
        lengths = np.fromiter((len(d) for d in drafts), np.int64, len(drafts))
        alphas = np.empty(len(requests))
        probes = False
        for index, (request, key) in enumerate(zip(requests, keys, strict=True)):
            request.draft_acceptance.key = key
            alphas[index] = self._alpha(request, key)
            probes = probes or request.draft_pause.probing
            request.draft_pause.probing = False
        if lengths.any():
            # The proposer's passes are spent: what remains to weigh is the verify step.
            costs = self.costs.costs(batch_size)
            gain = (_expected_tokens(alphas, width)[np.arange(len(requests)), lengths] - 1).sum()
            if probes or (batch_size + gain) * costs.plain > batch_size * costs.verify:
                return drafts
        elif self.preview is not None:  # nothing found to draft from: not the drafts' fault
            self._wait(requests, batch_size)
            return [[] for _ in requests]
        for request in requests:
            request.draft_pause.pause()
        return [[] for _ in requests]

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verify step of ``num_drafts`` of its drafts accepted ``num_accepted``: both
        estimates learn it. (Drafts accepted need not pay: the back-off resets only when
        ``plan`` finds them paying.)"""
        key = request.draft_acceptance.key
        request.draft_acceptance.add(key, num_drafts, num_accepted)
        self.engine_acceptance.add(key, num_drafts, num_accepted)
        if num_accepted:  # the draft guesses something: probes take their full share again
            self.probe_share = PROBE_SHARE

    def _wait(self, requests: list[Request], batch_size: int) -> None:
        """``requests`` have nothing to draft from: each looks again after as many steps as
        keep the batch's lookups within ``LOOKUP_SHARE`` of a plain step's time."""
        if requests:
            lookups = self.preview_seconds * batch_size
            steps = math.ceil(lookups / (LOOKUP_SHARE * self.costs.costs(batch_size).plain))
            for request in requests:
                request.draft_pause.wait(min(max(steps, 1), LONGEST_PAUSE))

    def _alpha(self, request: Request, key: int) -> float:
        prior = self.engine_acceptance.rate(key, FIRST_PRIOR)
        return request.draft_acceptance.rate(key, prior)

    def _probe_could_repay(self, num_due: int, batch_size: int) -> bool:
        """Whether drafts all accepted for ``num_due`` requests of a batch of ``batch_size``
        would gain, over a longest pause's steps of drafting, the tokens a probe's cost
        would have decoded: what a probe could find at best against what it costs."""
        costs = self.costs.costs(batch_size)
        _, drafting = self._best_width(np.ones(num_due), batch_size)
        gained_steps = (drafting - batch_size) / batch_size * LONGEST_PAUSE
        return gained_steps * costs.plain > costs.probe

    def _best_width(self, alphas: np.ndarray, batch_size: int) -> tuple[int, float]:
        """The k of most tokens a second for requests of acceptance ``alphas`` in a batch of
        ``batch_size``, and the tokens it makes in a plain step's time (drafting beats plain
        decoding where that is more than ``batch_size``)."""
        costs = self.costs.costs(batch_size)
        gains = (_expected_tokens(alphas, self.max_drafts)[:, 1:] - 1).sum(axis=0)
        rates = (batch_size + gains) / (costs.verify + self.widths * costs.draft_pass)
        best = int(rates.argmax())
        return best + 1, float(rates[best] * costs.plain)


def _expected_tokens(alphas: np.ndarray, max_drafts: int) -> np.ndarray:
    """[requests, max_drafts + 1]: E(alpha, k) = 1 + alpha + ... + alpha^k for k = 0, 1, ..."""
    powers = np.cumprod(np.repeat(alphas[:, None], max_drafts, axis=1), axis=1)
    return np.cumsum(np.concatenate([np.ones((alphas.size, 1)), powers], axis=1), axis=1)
