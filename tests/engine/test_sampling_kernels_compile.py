"""The sampling draw's kernels (engine/backends/triton/argmax.py, nucleus.py) and the
penalties' (penalties.py) compile for
sm_90 on this CPU machine, in every variant the engine launches, without spilling: the
interpreter the other tests run them in executes them as Python and numpy, and says nothing
of what Triton's compiler makes of their loops and branches, or of their registers, before
a GPU call does. Compiled in a process of its own: the tests' interpreter (TRITON_INTERPRET)
compiles nothing."""

from __future__ import annotations

from tandem.testing.processes import compiled_in_a_process

COMPILE = """
import json, sys
sys.path.insert(0, "scripts")
from kernel_resources import resources
from engine.backends.triton import argmax, nucleus, penalties
from tandem.testing.sm90 import compile_for_sm90

def compile(kernel, signature, num_warps, **constants):
    return resources(compile_for_sm90(kernel, signature, num_warps, **constants))[:2]

def signature(kernel, types):
    return {name: types.get(name, "i32") for name in kernel.arg_names}

types = {"logits_ptr": "*fp32", "values_ptr": "*fp32", "indices_ptr": "*i32", "maxes_ptr": "*fp32",
         "partials_ptr": "*fp32", "out_ptr": "*i64", "temperature_ptr": "*fp32", "seed_ptr": "*i64",
         "step_ptr": "*i64", "top_p_ptr": "*fp32", "top_k_ptr": "*i64", "min_p_ptr": "*fp32",
         "slots_ptr": "*i64", "counts_ptr": "*fp32", "prompt_ptr": "*u8", "presence_ptr": "*fp32",
         "frequency_ptr": "*fp32", "repetition_ptr": "*fp32"}
results = {}
for race, store_max in ((False, False), (True, False), (True, True)):
    results[f"chunk {race} {store_max}"] = compile(
        argmax._chunk_argmax_kernel, signature(argmax._chunk_argmax_kernel, types), 4,
        BLOCK=argmax.CHUNK, RACE=race, STORE_MAX=store_max)
for has_top, has_min_p in ((True, False), (False, True), (True, True)):
    cuts = dict(HAS_TOP=has_top, HAS_MIN_P=has_min_p, BLOCK=argmax.CHUNK, BLOCK_CHUNKS=64)
    results[f"mass {has_top} {has_min_p}"] = compile(
        nucleus._chunk_mass_kernel, signature(nucleus._chunk_mass_kernel, types), 4, **cuts)
    finish = nucleus._finish_kernel
    results[f"finish {has_top} {has_min_p}"] = compile(
        finish, signature(finish, types), nucleus._LOOP_WARPS, **cuts)
kernel = penalties._penalties_kernel
penalty_types = types | {"out_ptr": "*fp32"}
for repetition in (False, True):
    results[f"penalties {repetition}"] = compile(
        kernel, signature(kernel, penalty_types), 4, HAS_REPETITION=repetition,
        BLOCK=penalties._BLOCK)
print(json.dumps(results))
"""


def test_sampling_kernels_compile_for_sm90_without_spilling() -> None:
    results = compiled_in_a_process(COMPILE)
    assert len(results) == 11
    for variant, (registers, spilled) in results.items():
        assert 0 < registers <= 255 and spilled == 0, (variant, registers, spilled)
