"""Which token ids end generation: shared by every checkpoint format (the engine's EOS ids)
and by the server, whose own --chat-template may end turns with a token the engine does not
stop on."""

from __future__ import annotations

from collections.abc import Callable, Iterable

# Chat templates close each turn with one of these. A model trained on the template emits it at
# the end of its answer even when the config names another token as EOS, so generation must stop
# on it too.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")


def eos_token_ids(
    declared: Iterable[int | None],
    chat_template: str | None,
    token_to_id: Callable[[str], int | None],
) -> list[int]:
    """The declared EOS ids, then the template's end-of-turn token; no duplicates, order kept."""
    ids = [token_id for token_id in declared if token_id is not None]
    for token in END_OF_TURN_TOKENS:
        if chat_template is not None and token in chat_template:
            ids.append(token_to_id(token))
    return list(dict.fromkeys(token_id for token_id in ids if token_id is not None))
