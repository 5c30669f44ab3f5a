"""Fetch the real GGUF checkpoints that the slow tests read, into $TANDEM_CACHE_DIR:

    python scripts/fetch_test_gguf.py            # every model
    python scripts/fetch_test_gguf.py gemma3-270m

The models and how they are fetched: tandem/testing/gguf_models.py.
"""

from tandem.testing.gguf_models import main

if __name__ == "__main__":  # not in a child that multiprocessing spawns
    main()
