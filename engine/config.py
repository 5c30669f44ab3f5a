"""The engine's options, each written once: a dataclass field whose metadata is its help text.

``python -m engine``'s command line is generated from these fields (``add_arguments``), so an
option added here is a flag there, with the same name, default and help, and in-process users
(tests, benchmarks) build the same dataclasses directly. A renamed option keeps its old flag as
an alias (``aliases``) and, for in-process users, its old keyword (an ``InitVar``).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch

from engine.backends import BACKENDS
from engine.checkpoint.resolve import DEFAULT_MODEL
from engine.quantization.linear_methods import QUANTIZATION_METHODS
from engine.scheduling.waiting_queue import SCHEDULING_POLICIES
from protocol.flags import bounded

# A GPU's batch: each GPU that tensor parallelism adds holds 1/N of the weights and of the
# K/V, so its share of a step at N times the batch is one GPU's step at this one; at the same
# batch it would shrink N-fold while the step's fixed costs (the host's work, launches,
# collectives) stay.
MAX_NUM_SEQS_PER_GPU = 256


def default_max_num_seqs(tensor_parallel_size: int) -> int:
    """--max-num-seqs when none is given: one GPU's batch for each GPU of the model."""
    return MAX_NUM_SEQS_PER_GPU * max(tensor_parallel_size, 1)


# A step's token budget: a GPU computes 8192 tokens in milliseconds. A CPU takes tens of
# seconds over a long prompt's 8192 (a 135M model on two cores: 40 s), and the engine answers
# nothing during a step, so a server, which takes an engine silent for 30 s to be lost
# (server/engine_client.py), would refuse every request meanwhile: on the CPU a long prompt
# goes in chunks of seconds, the heartbeat between them. Its matrix products run about as
# fast on 512 rows as on 8192.
GPU_STEP_TOKENS = 8192
CPU_STEP_TOKENS = 512


def default_max_num_batched_tokens(device: str, max_num_seqs: int) -> int:
    """--max-num-batched-tokens when none is given, for a device and a batch (a step's budget
    holds each running request's token)."""
    per_step = CPU_STEP_TOKENS if torch.device(device).type == "cpu" else GPU_STEP_TOKENS
    return max(per_step, max_num_seqs)


def option(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    """A field with a default and the command line's help text (and choices, if any;
    ``aliases``, more flags for it, such as its old name; and a ``type``, ``bounded``, for a
    number with bounds)."""
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass
class EngineConfig:
    """What the engine loads and how it schedules; every field is a ``python -m engine`` flag."""

    model: str = option(
        DEFAULT_MODEL,
        "a Hugging Face directory, a hub name ORG/NAME, a .gguf file, or the default model's name",
    )
    served_model_name: str | None = option(
        None, "the model's name in the API (default: the checkpoint's)"
    )
    device: str = option(
        "cuda" if torch.cuda.is_available() else "cpu",
        "where the model runs (default: cuda when available)",
        choices=["cpu", "cuda"],
    )
    dtype: str = option(
        "auto",
        "weights and activations (auto: bfloat16 on CUDA, float32 on CPU)",
        choices=["auto", "bfloat16", "float16", "float32"],
    )
    kv_cache_dtype: str = option(
        "auto",
        "the KV cache's dtype: auto (the model's) or fp8 (float8 e4m3, stored unscaled as "
        "vLLM stores it without calibrated scales: half bf16's bytes, so twice the tokens "
        "and half the bytes for decode attention to read)",
        choices=["auto", "fp8"],
    )
    quantization: str | None = option(
        None,
        "the linear layers' weights, quantized at load with one scale per output channel: fp8 "
        "(float8 e4m3, compute capability >= 8.9; activations quantized per token) or int8 "
        "(weight-only, any GPU or the CPU). mxfp4: gpt-oss's MXFP4 experts stay MXFP4 in "
        "memory and the Triton backend's MoE kernels read them (untimed on a GPU); the other "
        "layers load as without it. Default: as the checkpoint stores them (a pre-quantized "
        "FP8 checkpoint loads as fp8; gpt-oss's MXFP4 experts dequantized to the model's dtype)",
        choices=list(QUANTIZATION_METHODS),
    )
    max_model_len: int | None = option(
        None,
        "context length (default: the model's, capped by what the KV cache holds)",
        type=bounded(int, at_least=1),
    )
    block_size: int = option(16, "tokens per KV cache block", type=bounded(int, at_least=1))
    kv_cache_memory_gb: float | None = option(
        None,
        "memory for the KV cache (default: 1 GiB on CPU; on CUDA, what "
        "--gpu-memory-utilization leaves)",
        type=bounded(float, above=0),
    )
    num_kv_blocks: int | None = option(
        None,
        "exact KV cache size in blocks; overrides the memory budget",
        type=bounded(int, at_least=1),
    )
    gpu_memory_utilization: float = option(
        0.9,
        "share of the GPU's memory for weights, activations and the KV cache",
        type=bounded(float, above=0, at_most=1),
    )
    max_num_seqs: int | None = option(
        None,
        "requests decoded together at most (default: 256 a GPU, 256 x --tensor-parallel-size, "
        "so that each GPU's share of a step stays as large as one GPU's)",
        type=bounded(int, at_least=1),
    )
    max_num_batched_tokens: int | None = option(
        None,
        "tokens one step computes at most; longer prompts are prefilled in chunks (default: "
        "8192; on the CPU 512, or --max-num-seqs if more: a step keeps to seconds there, "
        "within the servers' 30 s heartbeat)",
        type=bounded(int, at_least=1),
    )
    scheduling_policy: str = option(
        "fcfs",
        "the order waiting requests are admitted in: fcfs, as they came; priority, by the "
        "requests' priority (vLLM's: lower first), then as they came; either way the users "
        "of a priority take turns (engine/scheduling/waiting_queue.py)",
        choices=list(SCHEDULING_POLICIES),
    )
    separate_prefill_steps: bool = option(
        False,
        "a step that admits waiting requests computes their prompts alone, not the running "
        "requests' decodes, which wait for the next step (SGLang's default, where vLLM mixes "
        "them): a new request's first token comes sooner under load, each admission costs "
        "the running requests a step (docs/serving.md, Scheduling and the KV cache)",
    )
    enforce_eager: bool = option(
        False, "CUDA: no CUDA graphs for decode and verify steps (faster start, slower decode)"
    )
    split_mixed_steps: str = option(
        "auto",
        "a step of decodes with prompts mixed in run as two passes, the decodes' and the "
        "prompts', each a CUDA graph replay, instead of one eager pass: on, off, or auto (on "
        "where graphs are captured and the model is small enough that reading its weights "
        "twice costs less than launching a pass op by op; engine/execution/mixed_steps.py)",
        choices=["auto", "on", "off"],
    )
    enable_prefix_caching: bool = option(
        True, "reuse the KV cache of prompts' common prefixes (default: on)"
    )
    # None: on for CUDA; off on CPU, whose ops run as they are called (overlap would only
    # delay each token by a step).
    overlap_steps: bool | None = option(
        None,
        "launch each step before reading the last one's tokens, hiding the host's work "
        "behind the device's (default: on for CUDA, off on CPU)",
    )
    generation_config: str = option(
        "auto",
        "sampling defaults for what a request leaves out: auto, those of the model's "
        "generation_config.json; vllm, none (vLLM's names); or a directory holding a "
        "generation_config.json",
    )
    tensor_parallel_size: int = option(
        1,
        "GPUs the model is split over (tensor parallelism, NCCL; gloo on CPU): the engine "
        "starts a worker process for each but the first, which it drives itself",
        type=bounded(int, at_least=1),
    )
    load_format: str = option(
        "auto",
        "auto: the checkpoint's weights; dummy: random weights in the shape of its config.json "
        "(for benchmarks of shapes whose weights are not at hand; no weight files needed)",
        choices=["auto", "dummy"],
    )
    backend: str | None = option(
        None,
        "the implementation of every device operation: attention, the layers' norms and "
        "products, sampling's argmax and grammar masks, the step inputs' fills (default: "
        "triton on CUDA, torch on CPU; torch runs no Triton kernel, on any device)",
        choices=list(BACKENDS),
        aliases=["--attention-backend"],
    )
    speculative_method: str | None = option(
        None,
        "speculative decoding: ngram drafts tokens from the request's own prompt and output "
        "(prompt lookup), draft_model with --speculative-model; both verified in one forward "
        "pass (default: draft_model with --speculative-model, else none)",
        choices=["ngram", "draft_model"],
    )
    speculative_model: str | None = option(
        None,
        "speculative decoding with a draft model (as --model: a directory, hub name or .gguf) "
        "of the target's tokenizer, run in the engine's process with its own KV cache "
        "(tensor parallel size 1 only)",
    )
    num_speculative_tokens: int = option(
        16,
        "with --speculative-method: tokens drafted for each request a step, at most (adaptive: "
        "the policy drafts fewer where fewer pay, and on CUDA only for batches whose verify "
        "steps run as graphs: up to 576 tokens, 32 requests at 16)",
        type=bounded(int, at_least=1),
    )
    speculative_adaptive: bool = option(
        True,
        "with --speculative-method: k and the n-gram length follow each request's measured "
        "acceptance, and steps draft only where the expected tokens a second, at the step "
        "costs the engine measures at each batch size, beat plain decoding "
        "(engine/speculative/adaptive.py); --no-speculative-adaptive drafts k every step, "
        "paused by --speculative-pause-acceptance",
    )
    speculative_pause_acceptance: float = option(
        0.25,
        "with --no-speculative-adaptive: a request whose last 2 verify steps each accepted "
        "fewer than this share of their drafts is not drafted for its next 4 steps, twice as "
        "many each time again, up to 64 (0: never paused)",
        type=bounded(float, at_least=0, at_most=1),
    )
    speculative_disable_by_batch_size: int = option(
        0,
        "with --speculative-method: steps draft nothing (and overlap) while this many "
        "requests or more run (0: no such limit; the adaptive policy weighs each batch size's "
        "measured costs, and on CUDA drafts only for batches that verify graphs run)",
        type=bounded(int, at_least=0),
    )
    prompt_lookup_max: int = option(
        8,
        "ngram speculation: the longest n-gram looked up in the request's tokens",
        type=bounded(int, at_least=1),
    )
    prompt_lookup_min: int = option(
        2,
        "ngram speculation: the shortest n-gram looked up in the request's tokens",
        type=bounded(int, at_least=1),
    )
    # ``backend``'s old name, still taken as a keyword (``EngineConfig(attention_backend=...)``,
    # ``LLM(attention_backend=...)``); no field of its own, and no flag but --backend's alias.
    attention_backend: InitVar[str | None] = None

    def __post_init__(self, attention_backend: str | None) -> None:
        if self.max_num_seqs is None:
            self.max_num_seqs = default_max_num_seqs(self.tensor_parallel_size)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_max_num_batched_tokens(
                self.device, self.max_num_seqs
            )
        if attention_backend is None:
            return
        if self.backend not in (None, attention_backend):
            raise ValueError(
                f"backend={self.backend!r} and attention_backend={attention_backend!r}: "
                "attention_backend is backend's old name; give one"
            )
        self.backend = attention_backend

    @property
    def max_logits_rows(self) -> int:
        """Positions a step computes logits for at most: each request's next token's, and
        with speculative decoding those after its drafts."""
        drafts = self.num_speculative_tokens if self.speculation else 0
        return self.max_num_seqs * (1 + drafts)

    @property
    def speculation(self) -> str | None:
        """The speculative method: the one named, draft_model when only a draft model is
        given; None: no speculation."""
        if self.speculative_method is None and self.speculative_model is not None:
            return "draft_model"
        return self.speculative_method


@dataclass
class ServiceConfig:
    """How the engine process serves: its socket and its logs."""

    address: str = option(
        "ipc:///tmp/tandem-engine.sock", "ZeroMQ address to bind: ipc://PATH or tcp://HOST:PORT"
    )
    curve_secret_key: str | None = option(
        None,
        "CURVE: the engine's key pair (a .key_secret file, scripts/make_curve_keys.py); "
        "every connection is then encrypted and must present an authorized key",
    )
    curve_authorized_keys: str | None = option(
        None, "CURVE: a directory of the public keys (.key files) of the servers allowed in"
    )
    insecure: bool = option(
        False,
        "allow a tcp:// address that other hosts can reach without CURVE keys "
        "(unencrypted, open to anyone who reaches it)",
    )
    max_queued_requests: int = option(
        1024,
        "requests that may wait for a place in the batch beyond those free (SGLang's name); "
        "more are refused at once (HTTP 429 with Retry-After from the servers). The default "
        "absorbs bursts; under a sustained overload the queue stays full and each admitted "
        "request waits for those ahead of it: 0 (only as many as there are free places) keeps "
        "the admitted requests' time to first token",
        type=bounded(int, at_least=0),
    )
    max_queued_prompt_tokens: int | None = option(
        None,
        "prompt tokens left to compute (of requests waiting for a place, and of prompts being "
        "prefilled in chunks) past which a new request is refused (HTTP 429 with "
        "Retry-After): every step computes a share of them, so a burst of long prompts slows "
        "the first token of every request admitted after it. A request's own prompt counts: "
        "one longer than the bound is taken only when no other prompt tokens wait "
        "(default: no bound)",
        type=bounded(int, at_least=1),
    )
    max_compiling_grammars: int = option(
        32,
        "distinct grammars (structured outputs: JSON schemas, regexes, choices, grammars) that "
        "may compile at once, queued on the engine's grammar threads or running; a request "
        "whose constraint would start one more is refused at once (HTTP 429 with Retry-After), "
        "one whose grammar is compiled or compiling already never is. Ordinary schemas "
        "compile in tens of milliseconds, so the default absorbs bursts of them, while a "
        "flood of large distinct ones queues no more than this for the requests after it to "
        "wait behind",
        type=bounded(int, at_least=1),
    )
    max_unread_output_bytes: int = option(
        256 * 2**20,
        "bytes of output sent a server that it has not yet said it read (it says so each "
        "second, at the engine's heartbeat): a frame that would pass this is not sent and the "
        "server is dropped, its requests aborted, so that a server that stopped reading, or a "
        "peer that never reads, costs the engine about this much memory at most. Keep it "
        "above a server's largest frame (a long prompt's prompt log-probabilities: a few "
        "hundred bytes a token; 64 MiB at most) and a second or two of its output "
        "(default: 256 MiB)",
        type=bounded(int, at_least=1),
    )
    drain_timeout: float = option(
        10.0,
        "on SIGTERM, seconds the requests in flight may take to finish (new ones are refused) "
        "before the rest are aborted",
        type=bounded(float, at_least=0),
    )
    stats_interval: float = option(
        10.0, "seconds between throughput log lines (0: none)", type=bounded(float, at_least=0)
    )
    log_level: str = option("info", "logging level")
    step_record: str | None = option(
        None,
        "keep every step's shape and write them to this JSON file when the engine stops "
        "(for a benchmark's roofline: engine/roofline.py)",
    )


def add_arguments(parser: argparse.ArgumentParser, config_class: type) -> None:
    """A ``--flag-name`` for every field of the dataclass ``config_class``."""
    hints = typing.get_type_hints(config_class)
    for config_field in dataclasses.fields(config_class):
        kwargs = dict(config_field.metadata)
        aliases = kwargs.pop("aliases", ())
        kind = _value_type(hints[config_field.name])
        flag = "--" + config_field.name.replace("_", "-")
        kwargs["help"] = _with_default(kwargs["help"], config_field.default)
        if kind is bool:
            # --flag and --no-flag; a None default leaves the choice to the engine.
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            # A field's own ``type`` (a ``bounded`` one) converts to the same kind.
            kwargs.setdefault("type", kind)
        parser.add_argument(
            flag, *aliases, dest=config_field.name, default=config_field.default, **kwargs
        )


def _with_default(help_text: str, default: Any) -> str:
    """The help text with its default, where the text does not already say it (a default
    of None is the engine's choice, which the text describes)."""
    if default is None or "default" in help_text:
        return help_text
    if isinstance(default, bool):
        default = "on" if default else "off"
    return f"{help_text} (default: {default})"


def from_arguments(config_class: type, args: argparse.Namespace) -> Any:
    """An instance of the dataclass ``config_class`` from the parsed flags of its fields."""
    return config_class(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config_class)})


def _value_type(hint: Any) -> type:
    """``int`` for ``int | None``: the type a flag's text converts to."""
    if isinstance(hint, types.UnionType):
        (kind,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
        return kind
    return hint
