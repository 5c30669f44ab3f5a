"""A request's pauses from speculative drafting: while paused it is not drafted for, so that
where speculation cannot win (a draft that guesses badly, text that does not repeat itself)
it costs little.

A pause lasts 4 steps the first time, twice as many each time the request is paused again,
up to 64; ``reset`` makes the next one short again. Where the drafts' source can be looked at
from the host (prompt lookup), a request with nothing to draft from ``wait``s a few steps
instead, without growing the back-off. A paused request decodes as it would
without speculation (and a draft model catches up on its tokens in one forward pass when it
drafts again). When a pause ends the request is due for a probe (``probing``): at a fixed k
it drafts then, whatever the estimates say, so that text that starts repeating itself is
found again; the adaptive policy decides when (a preview of the drafts' source, or a probe
once plain steps earned it), and a due request stays due until then.

Who pauses a request: with ``--speculative-adaptive`` (the default), the policy of
``engine/speculative/adaptive.py``, when the measured acceptance makes a verify step a loss;
without it, ``record``: after ``POOR_STEPS_TO_PAUSE`` verify steps in a row that each accept
fewer than the threshold's share of their drafts (``--speculative-pause-acceptance``); a
verify step at or above the threshold ends the streak and resets the back-off.
"""

from __future__ import annotations

from dataclasses import dataclass

POOR_STEPS_TO_PAUSE = 2
FIRST_PAUSE = 4
LONGEST_PAUSE = 64


@dataclass
class DraftPause:
    """One request's drafting pace."""

    poor_steps: int = 0  # verify steps in a row below the threshold (fixed drafting)
    steps_left: int = 0  # steps it is not drafted for, from now
    next_pause: int = FIRST_PAUSE
    probing: bool = False  # its pause ended: due for a probe

    def may_draft(self) -> bool:
        """Whether this step drafts for it; a paused request's pause counts the step."""
        if self.steps_left:
            self.steps_left -= 1
            self.probing = not self.steps_left
            return False
        return True

    def pause(self) -> None:
        """Draft nothing for it for the next pause's steps; the one after is twice as long."""
        self.steps_left = self.next_pause
        self.next_pause = min(2 * self.next_pause, LONGEST_PAUSE)
        self.probing = False

    def wait(self, steps: int) -> None:
        """Nothing to draft from now (prompt lookup found no earlier copy of the request's
        latest tokens): draft nothing for ``steps`` steps, then look again. The back-off does
        not grow: looking costs a lookup, not a verify step, and text that starts copying
        its input is found within those steps."""
        self.steps_left = steps
        self.probing = False

    def reset(self) -> None:
        """Its drafts paid: a later pause starts short again."""
        self.poor_steps = 0
        self.next_pause = FIRST_PAUSE

    def record(self, num_drafts: int, num_accepted: int, threshold: float) -> None:
        """A verify step of ``num_drafts`` drafts accepted ``num_accepted`` (fixed drafting)."""
        self.probing = False
        if num_accepted >= threshold * num_drafts:
            self.reset()
            return
        self.poor_steps += 1
        if self.poor_steps >= POOR_STEPS_TO_PAUSE:
            self.poor_steps = 0
            self.pause()
