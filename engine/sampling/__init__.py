"""From a step's logits to its tokens: sampling every sequence at once (``sampler.py``),
grammars of structured outputs (``structured_output.py``) and the dead ends they can meet
with a request's own restrictions (``token_restrictions.py``), prompt log-probabilities
(``prompt_logprobs.py``), and the rule that accepts speculative drafts
(``rejection_sampler.py``)."""
