"""Tensor parallelism: one engine over N GPUs, one process per GPU.

The engine's own process is rank 0: it keeps the ROUTER socket, the scheduler, the requests
and the sampler, and runs its ModelRunner on GPU 0. ``WorkerGroup`` starts ranks 1 … N-1
(``workers.py``), each a ModelRunner of its part of the model on its own GPU that runs the
forward passes rank 0 sends it (``step_channel.py``) and nothing else. What the model's
layers see of it (rank, shares, collectives) is ``engine.distributed``'s.
"""

from engine.tensor_parallel.workers import WorkerGroup

__all__ = ["WorkerGroup"]
