"""bench/profile/refine_phases.py: the phases it times add up to the call, and the wrapped functions are restored."""

from __future__ import annotations

import torch

from bench.profile import refine_phases
from kimi_nvfp4.numerics.methods.output_aware import gptq_solver, refine


def test_the_phases_of_a_small_gptq_batch_add_up_and_the_functions_come_back():
    before = (refine.quantize_group, refine._guarded, gptq_solver.gptq_quantize)
    items = refine_phases.synthetic_items(2, 256, torch.device("cpu"), hidden=128, intermediate=64)
    record = refine_phases.profile_phases("gptq", items, 2, torch.device("cpu"))
    phases = record["phase_seconds"]
    assert set(phases) == {"search", "hessians", "solver", "guard", "other"}
    assert all(phases[p] > 0 for p in ("search", "hessians", "solver", "guard"))  # each phase ran
    assert abs(sum(phases.values()) - record["total_s"]) < 1e-3
    assert (refine.quantize_group, refine._guarded, gptq_solver.gptq_quantize) == before
