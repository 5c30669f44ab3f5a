"""Speculative decoding: proposers draft tokens that a request's next step verifies at once
(``ngram.py``: prompt lookup), and the rule that accepts them (``rejection_sampler.py``)."""
