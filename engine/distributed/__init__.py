"""Tensor parallelism as the model's layers see it: this process's rank and share of each
dimension (``parallel.py``), and the collectives its layers call, small all-reduces through
symmetric memory among them (``symmetric_all_reduce.py``). The worker processes that run
the other ranks are ``engine.tensor_parallel``'s."""
