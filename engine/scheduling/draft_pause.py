"""Auto-off on low acceptance: a request whose drafts keep being rejected is not drafted for
a while, so that where speculation cannot win (a draft that guesses badly, text that does not
repeat itself) it costs little.

After ``POOR_STEPS_TO_PAUSE`` verify steps in a row that each accept fewer than the
threshold's share of their drafts (``--speculative-pause-acceptance``), the request's next
``backoff`` steps draft nothing for it: 4 steps the first time, twice as many each time it
is paused again, up to 64. A verify step at or above the threshold ends the streak and the
back-off starts over at 4. A paused request decodes as it would without speculation (and a
draft model catches up on its tokens in one forward pass when it drafts again).
"""

from __future__ import annotations

from dataclasses import dataclass

POOR_STEPS_TO_PAUSE = 2
FIRST_PAUSE = 4
LONGEST_PAUSE = 64


@dataclass
class DraftPause:
    """One request's drafting pace."""

    poor_steps: int = 0  # verify steps in a row below the threshold
    steps_left: int = 0  # steps it is not drafted for, from now
    next_pause: int = FIRST_PAUSE

    def may_draft(self) -> bool:
        """Whether this step drafts for it; a paused request's pause counts the step."""
        if self.steps_left:
            self.steps_left -= 1
            return False
        return True

    def record(self, num_drafts: int, num_accepted: int, threshold: float) -> None:
        """A verify step of ``num_drafts`` drafts accepted ``num_accepted``."""
        if num_accepted >= threshold * num_drafts:
            self.poor_steps = 0
            self.next_pause = FIRST_PAUSE
            return
        self.poor_steps += 1
        if self.poor_steps >= POOR_STEPS_TO_PAUSE:
            self.poor_steps = 0
            self.steps_left = self.next_pause
            self.next_pause = min(2 * self.next_pause, LONGEST_PAUSE)
