"""The tensor-parallel worker processes: started by the engine, one per GPU past the first.

Why rank 0 is the engine's process (vLLM's "driver worker"): the scheduler, the requests, the
grammar matchers and the sampler all live there already, and sampling needs the whole
vocabulary's logits, which the LM head gathers on every rank anyway. So rank 0 samples once,
in place, with the overlapped steps and the grammar masks exactly as with one GPU, and the
workers need nothing but each step's packed inputs. The cost is that rank 0's host work
(scheduling, packing, reading results) is on the critical path of every rank, which the
overlapped steps already hide behind the device's work.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from engine.backends import create_backend
from engine.checkpoint import Checkpoint
from engine.config import EngineConfig
from engine.distributed.parallel import TensorParallel
from engine.distributed.symmetric_all_reduce import with_symmetric_all_reduce
from engine.execution.model_runner import ModelRunner, rank_device, resolve_dtype
from engine.execution.warm_up import freeze_start_up_objects
from engine.model_config import ModelConfig
from engine.models import load_checkpoint
from engine.models.gpt_oss import check_mxfp4_experts
from engine.tensor_parallel.step_channel import StepReceiver, StepSender

logger = logging.getLogger(__name__)

# NVLink multicast stays off in NCCL, PyTorch and NVSHMEM: the GPU machines require it. Set in
# the engine's environment before NCCL starts, so its workers inherit it too.
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
_HOST = "127.0.0.1"  # the ranks' rendezvous (a TCPStore of rank 0's): one machine
_CLOSE_SECONDS = 10  # how long closing waits for each worker, and for the group


class WorkerGroup:
    """Rank 0's side: the worker processes, the process group and the pipe to each worker.

    If a worker dies, every collective would wait for it forever: the engine logs which one
    and exits, stopping the others (a supervisor, or the user, restarts it)."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint) -> None:
        size = config.tensor_parallel_size
        check_splits(checkpoint.config, size)
        check_mxfp4_experts(config.quantization, checkpoint, size)
        if config.device == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(
                f"--tensor-parallel-size {size} needs {size} GPUs; "
                f"{torch.cuda.device_count()} are visible"
            )
        os.environ.update(NO_MULTICAST)
        store = dist.TCPStore(_HOST, 0, size, is_master=True, wait_for_workers=False)
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA state
        self.processes: list[BaseProcess] = []
        pipes: list[Connection] = []
        for rank in range(1, size):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(
                target=worker_main,
                args=(config, rank, store.port, reader, logging.getLogger().level),
                name=f"tensor-parallel rank {rank}",
                daemon=True,
            )
            process.start()
            reader.close()  # the worker's end; the engine keeps only the writer
            self.processes.append(process)
            pipes.append(writer)
        self._closing = False
        threading.Thread(target=self._watch, name="tensor-parallel watch", daemon=True).start()
        self.tp = _join_process_group(config, store, 0)
        self.sender = StepSender(pipes)
        # An engine that exits without closing (an exception) still stops its workers: this
        # runs before multiprocessing's own exit handler, which would wait for them forever.
        atexit.register(self.close)
        logger.info(
            "tensor parallelism over %d %s ranks: started %d workers", size, config.device, size - 1
        )

    def close(self) -> None:
        """Stop the workers (each finishes the step it runs) and leave the process group
        with them. Every rank has freed its CUDA graphs first (``LLMEngine.close``,
        ``worker_main``): with them alive the teardown did not return. Rank 0
        leaves while the workers do, since some NCCL versions tear a communicator down on
        all ranks together, and stops waiting after a while in case one of them is gone."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        self.sender.stop()
        leaving = threading.Thread(target=dist.destroy_process_group, name="leave group")
        leaving.daemon = True
        leaving.start()
        for process in self.processes:
            process.join(timeout=_CLOSE_SECONDS)
            if process.is_alive():
                process.kill()
        leaving.join(timeout=_CLOSE_SECONDS)
        if leaving.is_alive():
            logger.warning("the process group did not close in %d s: left open", _CLOSE_SECONDS)

    def _watch(self) -> None:
        by_sentinel = {process.sentinel: process for process in self.processes}
        exited = wait(list(by_sentinel))
        if self._closing:
            return
        process = by_sentinel[exited[0]]  # type: ignore[index]
        process.join(timeout=1)  # reaped, for its exit code
        logger.critical(
            "%s exited (code %s): the engine cannot run without it, and stops",
            process.name,
            process.exitcode,
        )
        for other in self.processes:
            if other.is_alive():
                other.kill()
        os._exit(1)


def check_splits(config: ModelConfig, size: int) -> None:
    """Fail before any process starts if the model does not split over ``size`` ranks."""
    tp = TensorParallel(0, size)
    tp.split(config.num_attention_heads, "the number of attention heads")
    tp.kv_heads(config.num_key_value_heads)
    tp.split(config.intermediate_size, "intermediate_size")


def _join_process_group(config: EngineConfig, store: dist.Store, rank: int) -> TensorParallel:
    """Join the ranks' group; this rank's ``TensorParallel``, with symmetric memory for small
    all-reduces where the GPUs share it."""
    backend = "nccl" if config.device == "cuda" else "gloo"
    if config.device == "cuda":
        torch.cuda.set_device(rank)  # NCCL's communicator binds the current device
    size = config.tensor_parallel_size
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    tp = TensorParallel(rank, size)
    device = rank_device(config.device, tp)
    dtype = resolve_dtype(config.dtype, device)
    ops = create_backend(config.backend, device).ops  # the model runner's choice of kernels
    return with_symmetric_all_reduce(tp, device, dtype, make=ops.one_kernel_all_reduce)


def worker_main(
    config: EngineConfig, rank: int, store_port: int, pipe: Connection, log_level: int
) -> None:
    """A worker process: join the group, load this rank's part of the model, then run each
    step rank 0 sends until it says stop (or is gone)."""
    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s engine rank {rank} %(name)s: %(message)s",
    )
    # Ctrl-C or a SIGTERM to the process group is the engine's to act on: it stops the
    # workers between steps, and a worker gone mid-step would stop it instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    size = config.tensor_parallel_size
    if config.device == "cpu":
        # The ranks share the machine's cores instead of each taking all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    store = dist.TCPStore(_HOST, store_port, size, is_master=False)
    tp = _join_process_group(config, store, rank)
    runner = ModelRunner(config, load_checkpoint(config.model), tp)
    receiver = StepReceiver(pipe, runner.device)
    freeze_start_up_objects()  # a collection's stall here would stall every rank's step
    with torch.inference_mode():
        while (inputs := receiver.receive()) is not None:
            runner.run_model(inputs)
    runner.release_graphs()  # before the group closes, as rank 0 does
    dist.destroy_process_group()
