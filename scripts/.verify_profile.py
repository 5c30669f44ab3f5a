"""Scratch (s54): wall per engine.step() of fixed-k n-gram verify steps at batch B (prompts that
repeat a cycle, so every step drafts K), against plain decode steps; then the torch profiler's
kernels over 20 verify steps."""
import sys, time, statistics
import torch
from torch.profiler import ProfilerActivity, profile
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol import SamplingParams

model, batch, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def engine_for(spec: bool) -> LLMEngine:
    extra = dict(speculative_method="ngram", num_speculative_tokens=k, speculative_adaptive=False,
                 speculative_disable_by_batch_size=0) if spec else {}
    return LLMEngine(EngineConfig(model=model, load_format="dummy", max_num_seqs=max(batch, 16),
                                  max_model_len=4096, **extra))
for spec in (False, True):
    engine = engine_for(spec)
    cycle = list(range(100, 100 + k + 1))
    for i in range(batch):
        engine.add_request(b"t", str(i), (cycle * (700 // len(cycle)))[:700] + [i + 7],
                           SamplingParams(max_tokens=3000, ignore_eos=True))
    for _ in range(30):
        engine.step()
    walls = []
    for _ in range(60):
        t = time.perf_counter(); engine.step(); walls.append(time.perf_counter() - t)
    d0 = engine.num_draft_tokens
    print(f"{'verify' if spec else 'plain'} batch {batch} k {k}: wall a step median {statistics.median(walls)*1e3:.3f} ms "
          f"(min {min(walls)*1e3:.3f}, max {max(walls)*1e3:.3f}); drafts {engine.num_draft_tokens} accepted {engine.num_accepted_tokens}", flush=True)
    if spec:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(20):
                engine.step()
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=18))
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    for r in list(engine.requests.values()):
        engine.abort(r.client, r.request_id)
    engine.close() if hasattr(engine, "close") else None
    del engine; torch.cuda.empty_cache()
