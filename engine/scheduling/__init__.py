"""Which requests run in the next step: a request's state (``request.py``), the KV cache's
blocks and cached prefixes (``block_manager.py``), continuous batching within a token budget
(``scheduler.py``), and a request's speculative drafting: its pauses (``draft_pause.py``)
and the measured acceptance of its drafts (``draft_acceptance.py``)."""
