"""One K2.6-shaped MoE layer's attend + feed_forward over SAMPLES x SEQ_LEN tokens with the hidden states on the GPU
against in pinned host memory (the memory plan's fallback; transfers overlapped with compute: model/host_states.py).

The layer is synthesised in memory on the GPU (bench/harness/synthetic_layer.py) and loaded once, so only the two
halves of the layer and the state transfers are timed. Prints seconds for each placement and their ratio, and
checks that both give bit-identical states.

    python -m bench.speed.host_states --device cuda --json bench/results/host_states_64x2048_h200.json
"""

from __future__ import annotations

import json
import time

import torch

from bench.harness.results import bench_parser, write_result
from bench.harness.synthetic_layer import MODES, MOE_LAYER, InMemoryLayerSource, synthetic_moe_layer
from kimi_nvfp4.checkpoint.k2_config import K2Config
from kimi_nvfp4.model.runner import CUDA_MAX_CHUNK_TOKENS, HiddenStates, LayerStreamRunner
from kimi_nvfp4.synth.configs import deepseek_v3_text_config


def _states(host: list[torch.Tensor], where: str, device: torch.device) -> HiddenStates:
    if where == "cpu":
        return HiddenStates([t.clone().pin_memory() for t in host])
    return HiddenStates([t.to(device) for t in host])


def _time_layer(runner: LayerStreamRunner, w, states: HiddenStates, device: torch.device) -> tuple[dict, HiddenStates]:
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    attended = runner.attend(MOE_LAYER, states, w)
    torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    out = runner.feed_forward(attended, w)
    torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    return {"attend_s": t1 - t0, "feed_forward_s": t2 - t1, "layer_s": t2 - t0}, out


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--device", choices=["cuda"], default="cuda", help="the compute device (CUDA only)")
    parser.add_argument("--samples", type=int, default=64, help="sequences")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--experts", type=int, default=384, help="routed experts of the synthetic layer")
    parser.add_argument("--mode", choices=MODES, default="nvfp4-w4a4", help="the layer's expert linears")
    parser.add_argument("--max-chunk-tokens", type=int, default=CUDA_MAX_CHUNK_TOKENS)
    parser.add_argument("--materialize", action="store_true", help="dequantize the layer once (else per chunk)")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per placement (the fastest is kept)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the host-states path only exists when computing on a GPU)")
    device = torch.device(args.device)
    dtype = torch.bfloat16
    cfg = K2Config.from_dict(deepseek_v3_text_config("k2.6", layers=2, experts=args.experts))
    layer = synthetic_moe_layer(cfg, args.mode, device, dtype=dtype)
    source = InMemoryLayerSource(cfg, layer)
    g = torch.Generator().manual_seed(0)
    host = [torch.randn(args.seq_len, cfg.hidden_size, generator=g).to(dtype) for _ in range(args.samples)]
    warm = [t[: min(64, args.seq_len)] for t in host[:2]]
    timings: dict[str, dict] = {}
    outputs: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for where in ("cuda", "cpu"):
            runner = LayerStreamRunner(source, device=device, dtype=dtype, max_chunk_tokens=args.max_chunk_tokens,
                                       states_device=where, progress=False, materialize_layers=args.materialize)
            w = runner.load_layer(MOE_LAYER)
            _time_layer(runner, w, _states(warm, where, device), device)  # kernels, allocator, copy streams
            best = None
            for _ in range(args.repeats):
                states = _states(host, where, device)
                t, out = _time_layer(runner, w, states, device)
                best = t if best is None or t["layer_s"] < best["layer_s"] else best
            timings[where] = {k: round(v, 3) for k, v in best.items()}
            outputs[where] = [s.cpu() for s in out.sequences]
            del runner, w, states, out
            torch.cuda.empty_cache()
    identical = all(torch.equal(a, b) for a, b in zip(outputs["cuda"], outputs["cpu"]))
    gpu_s, host_s = timings["cuda"]["layer_s"], timings["cpu"]["layer_s"]
    print(f"states on GPU:       {gpu_s:8.2f} s  (attend {timings['cuda']['attend_s']:.2f}, "
          f"feed_forward {timings['cuda']['feed_forward_s']:.2f})")
    print(f"states pinned host:  {host_s:8.2f} s  (attend {timings['cpu']['attend_s']:.2f}, "
          f"feed_forward {timings['cpu']['feed_forward_s']:.2f})")
    print(f"host / GPU: {host_s / gpu_s:.3f}; states bit-identical: {identical}")
    result = {
        "case": "k2.6-moe-layer attend+feed_forward", "mode": args.mode, "samples": args.samples,
        "seq_len": args.seq_len, "tokens": args.samples * args.seq_len, "experts": args.experts,
        "max_chunk_tokens": args.max_chunk_tokens, "materialize": args.materialize, "dtype": "bfloat16",
        "repeats": args.repeats, "states_on_gpu": timings["cuda"], "states_on_host": timings["cpu"],
        "host_over_gpu": round(host_s / gpu_s, 3), "bit_identical": identical,
    }
    print(json.dumps(write_result(args.json, result, device=device), indent=2))


if __name__ == "__main__":
    main()
