"""Which requests run in the next step: a request's state (``request.py``), the KV cache's
blocks and cached prefixes (``block_manager.py``), continuous batching within a token budget
(``scheduler.py``), and the pause of requests whose speculative drafts keep failing
(``draft_pause.py``)."""
