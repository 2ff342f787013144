"""What a resume snapshot costs on this host: write and read rates of `stage_kit.resume.ResumeStore` with
hidden-state streams of K2.6's width, held on the compute device as calibrate and validate hold them.

    python -m bench.speed.resume_snapshot --device cuda --folder /tmp/snap --streams 2 --samples 128 \
        --json bench/results/resume_snapshot_h200.json

Writes one snapshot (`--streams` streams x `--samples` sequences x `--seq-len` tokens x `--hidden` bf16) through
the stages' own code (streaming shard writer, fsync, rename), then loads every stream back onto the device. The
read comes from the page cache when the snapshot fits in memory, so it is the best case, not a cold-disk read.
The projection (labelled as one) scales the measured write rate to K2.6's 512 x 2048 held-out tokens per stream:
validate snapshots four streams (INT4, W4A4, W4A16, baseline), calibrate one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict


from bench.harness.provenance import provenance

from kimi_nvfp4.distributed import RankContext
from kimi_nvfp4.stage_kit.device import resolve_device
from kimi_nvfp4.stage_kit.resume import ResumeStore

K26_HIDDEN = 7168
K26_TOKENS_PER_STREAM = 512 * 2048
VALIDATE_STREAMS = 4
CALIBRATE_STREAMS = 1
BF16_BYTES = 2


class _State(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="constants")
    note: str = "bench"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--folder", type=Path, default=Path("/tmp/kimi_nvfp4_snapshot_bench"))
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=K26_HIDDEN)
    ap.add_argument("--json", type=Path, default=Path("resume_snapshot.json"))
    args = ap.parse_args()

    dev = resolve_device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    streams = {
        f"stream{s}": [torch.randn(args.seq_len, args.hidden, generator=gen, device=dev, dtype=torch.bfloat16)
                       for _ in range(args.samples)]
        for s in range(args.streams)
    }
    nbytes = sum(t.numel() * t.element_size() for seqs in streams.values() for t in seqs)
    shutil.rmtree(args.folder, ignore_errors=True)
    store = ResumeStore(args.folder, "bench", RankContext(), {"bench": 1}, every=1)
    _sync(dev)
    t = time.perf_counter()
    if not store.save(0, _State(), streams):
        raise SystemExit("the snapshot could not be written (see the warning above)")
    write_s = time.perf_counter() - t

    snapshot = store.load()
    t = time.perf_counter()
    loaded = {name: snapshot.stream(name, dev) for name in streams}
    _sync(dev)
    read_s = time.perf_counter() - t
    same = all(torch.equal(a, b) for name in streams for a, b in zip(streams[name], loaded[name]))
    store.finish()

    write_rate = nbytes / write_s
    stream_bytes = K26_TOKENS_PER_STREAM * K26_HIDDEN * BF16_BYTES
    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "folder": str(args.folder),
        "streams": args.streams, "samples": args.samples, "seq_len": args.seq_len, "hidden": args.hidden,
        "snapshot_bytes": nbytes,
        "write_seconds": write_s, "write_gb_per_s": write_rate / 1e9,
        "read_seconds": read_s, "read_gb_per_s": nbytes / read_s / 1e9,
        "read_back_identical": same,
        "projected_k26_validate_snapshot_seconds": VALIDATE_STREAMS * stream_bytes / write_rate,
        "projected_k26_calibrate_snapshot_seconds": CALIBRATE_STREAMS * stream_bytes / write_rate,
        "projection_from": f"the write rate of one {nbytes / 1e9:.1f} GB snapshot; K2.6: 512 x 2048 tokens x "
                           f"{K26_HIDDEN} bf16 per stream, {VALIDATE_STREAMS} streams (validate), "
                           f"{CALIBRATE_STREAMS} (calibrate)",
        **provenance(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
