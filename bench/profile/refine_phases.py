"""Where an output-aware method's time goes per batch of experts, phase by phase (issue 26: inside `calibrate
--method gptq` the solve phase took 39.8 s for a 384-expert K2.6 layer on the H200, of which the solver alone is
~12.8 s by bench/profile/gptq.py; this names the rest).

Runs `requantize_experts(METHOD, ...)` -- what `calibrate --method` runs per solve batch (calibrate/fused_method.py
`_solve`) -- on `--experts` synthetic experts of K2.6's shapes (gate+up reading the 7,168-wide hidden state, down the
2,048-wide intermediate, INT4 on compressed-tensors' grid) with dense statistics from `--tokens` Gaussian rows per
input (timing only: the values are not calibration data), and times its phases by wrapping the functions that do
them, with a device sync on each side:

    search      the weight-error search each expert starts from (`refine.quantize_group`)
    hessians    the statistics made into the solver's float64 Hessians (`catalog/gptq._shrunk_hessian`)
    solver      the batched GPTQ (`gptq_solver.gptq_quantize`)
    guard       each matrix's weighted output error against the search's (`refine._guarded`)
    other       the rest of the call (moving statistics, stacking, packing the codes)

    python -m bench.profile.refine_phases --device cuda --experts 13 --json bench/results/refine_phases_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.harness.provenance import provenance
from bench.harness.synthetic_experts import HIDDEN, MOE_INTERMEDIATE, synthetic_int4
from kimi_nvfp4.numerics.methods import ExpertMatrices, InputStatsAccumulator, requantize_experts
from kimi_nvfp4.numerics.methods.catalog import gptq as gptq_catalog
from kimi_nvfp4.numerics.methods.output_aware import gptq_solver
from kimi_nvfp4.numerics.methods.output_aware import refine as refine_module

K26_EXPERTS = 384
# (module, attribute, phase): the functions whose time is a phase (module docstring)
PHASES = ((refine_module, "quantize_group", "search"), (gptq_catalog, "_shrunk_hessian", "hessians"),
          (gptq_solver, "gptq_quantize", "solver"), (refine_module, "_guarded", "guard"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def timed_phases(device: torch.device, seconds: dict[str, float]):
    """Wrap each of PHASES' functions so that its wall time (device-synced) adds to `seconds[phase]`; restored after.
    A phase called from inside another (none of these nest) would be counted in both."""
    originals = [(module, name, getattr(module, name)) for module, name, _ in PHASES]

    def wrap(fn, phase):
        def timed(*args, **kwargs):
            _sync(device)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync(device)
                seconds[phase] += time.perf_counter() - start
        return timed

    try:
        for (module, name, fn), (_, _, phase) in zip(originals, PHASES):
            setattr(module, name, wrap(fn, phase))
        yield seconds
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)


def _stats(width: int, tokens: int, gen: torch.Generator, device: torch.device):
    acc = InputStatsAccumulator(width, dense=True, device=device)
    scales = torch.exp(torch.randn(width, generator=gen, device=device) * 0.5)
    acc.add(torch.randn(tokens, width, generator=gen, device=device) * scales)
    return acc.stats()


def synthetic_items(experts: int, tokens: int, device: torch.device, hidden: int = HIDDEN,
                    intermediate: int = MOE_INTERMEDIATE, seed: int = 0) -> list[ExpertMatrices]:
    """Per expert its gate+up item and its down item, as `calibrate --method` builds them, with dense statistics."""
    weights = torch.Generator().manual_seed(seed)  # synthetic_int4 draws on the host, then moves the matrix
    rows = torch.Generator(device=device).manual_seed(seed)
    items = []
    for e in range(experts):
        gate, up = (synthetic_int4(intermediate, hidden, weights, str(device)) for _ in range(2))
        down = synthetic_int4(hidden, intermediate, weights, str(device))
        items.append(ExpertMatrices(f"experts.{e}.gate_up", [gate, up], _stats(hidden, tokens, rows, device)))
        items.append(ExpertMatrices(f"experts.{e}.down", [down], _stats(intermediate, tokens, rows, device)))
    return items


def profile_phases(method: str, items: list[ExpertMatrices], experts: int, device: torch.device) -> dict:
    seconds: dict[str, float] = defaultdict(float)
    _sync(device)
    start = time.perf_counter()
    with timed_phases(device, seconds):
        requantize_experts(method, items, batch_experts=experts)
    _sync(device)
    total = time.perf_counter() - start
    phases = {phase: round(seconds[phase], 4) for _, _, phase in PHASES}
    phases["other"] = round(total - sum(seconds.values()), 4)
    return {"total_s": round(total, 4), "phase_seconds": phases, "s_per_expert": total / experts,
            "projected_s_per_384_experts": total / experts * K26_EXPERTS,
            "projected_phase_seconds_per_384_experts": {k: round(v / experts * K26_EXPERTS, 2) for k, v in phases.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--experts", type=int, default=13, help="experts in one solve batch (the H200 plan's 13)")
    ap.add_argument("--method", default="gptq")
    ap.add_argument("--tokens", type=int, default=8192, help="statistics rows per input (at least the input width)")
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="smaller for a quick CPU run")
    ap.add_argument("--intermediate", type=int, default=MOE_INTERMEDIATE)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    warm = synthetic_items(1, args.tokens, device, args.hidden, args.intermediate, seed=1)
    requantize_experts(args.method, warm, batch_experts=1)  # kernels compiled, libraries loaded: not timed
    items = synthetic_items(args.experts, args.tokens, device, args.hidden, args.intermediate)
    record = {**provenance(device=device), "method": args.method, "experts": args.experts, "tokens": args.tokens,
              "hidden": args.hidden, "intermediate": args.intermediate,
              **profile_phases(args.method, items, args.experts, device)}
    print(json.dumps(record, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
