"""A publishable folder: a tiny K2 checkpoint with a complete manifest (real sha256s), validate and serve-check
reports, and the source's model card — what convert/calibrate/validate/serve-check leave behind."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kimi_nvfp4.checkpoint.manifest import (
    ConversionManifest,
    ConversionSettings,
    ShardRecord,
    SourceRecord,
    StageRecord,
    save_manifest,
)
from kimi_nvfp4.checkpoint.reader import CheckpointReader
from kimi_nvfp4.checkpoint.verdict import DataFingerprint, ValidateVerdict, load_file_digests
from kimi_nvfp4.validate.gates import DEFAULT_GATES

SOURCE_CARD = """---
license: other
license_name: modified-mit
license_link: LICENSE
library_name: transformers
---
# Kimi K2.6 (tiny test copy)
"""
# Shapes follow validate/report.py ValidationReport and serve_check/report.py ServeCheckReport (abridged).
VALIDATE_REPORT = {
    "checkpoint": "/local/path/out", "source": "/local/path/src",
    "settings": {"data": "builtin", "samples": 4, "seq_len": 64, "seed": 0, "modes": ["w4a4"]},
    "sequences": 4, "tokens": 256,
    "weights": {"matrices": 48, "rel_mse_mean": 0.0054, "rel_mse_max": 0.0059, "exact_fraction": 0.143},
    "end_to_end": [{"mode": "w4a4", "positions": 256, "kl_mean": 0.0123, "kl_p99": 0.05, "top1": 0.97,
                    "ppl_int4": 5.1, "ppl_nvfp4": 5.2, "ppl_ratio": 1.02}],
    "gates": [
        {"name": "structure.nvfp4_tensors", "value": None, "threshold": None, "comparison": "", "passed": True},
        {"name": "w4a4.kl_mean", "value": 0.0123, "threshold": 0.05, "comparison": "<=", "passed": True},
        {"name": "w4a4.top1", "value": 0.97, "threshold": 0.9, "comparison": ">=", "passed": True},
    ],
    "passed": True,
}
SERVE_REPORT = {
    "target": {"label": "b200-tp4", "profile": "b200-tp4", "reference_emulator": False,
               "server_info": {"quantization": "modelopt_fp4"}},
    "load": {"turns": 3, "output_tokens": 8, "points": [
        {"concurrency": 4, "requests": 12, "errors": 0, "ttft_p50_s": 0.25, "tpot_p50_ms": 14.0,
         "interactivity_tok_s": 71.4, "throughput_tok_min_gpu": 52000.0, "cache_hit_rate": 0.91}]},
    "quality": {"humaneval": {"problems": 3, "pass_at_1": 0.667}},
    "gates": [{"name": "mean |dlogprob| vs emulator", "value": 0.01, "threshold": 0.25, "comparison": "<=",
               "passed": True}],
    "passed": True,
}
# A 1x1 PNG (the chart's bytes do not matter to publish; only that it is uploaded and linked).
PNG_1X1 = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                        "1f15c4890000000d49444154789c6360000002000100e221bc330000000049454e44ae426082")


def sealed_verdict(folder: Path, shards: dict[str, ShardRecord], *, passed: bool) -> dict:
    """A verdict as validate seals it (checkpoint/verdict.py), over the folder's current shard and load-file digests."""
    return ValidateVerdict(
        passed=passed, failed_gates=[] if passed else ["w4a4.kl_mean"],
        shards={f: r.sha256 for f, r in shards.items()}, load_files=load_file_digests(folder),
        thresholds=DEFAULT_GATES.model_dump(mode="json"), thresholds_sha256="0" * 64,
        data=DataFingerprint(spec="builtin", seed=0, samples=4, seq_len=64, sequences=4, tokens=256,
                             tokens_sha256="1" * 64),
        modes=["w4a4"], input_scale_reduction="layer_max", sealed_at="2026-11-29T08:10:00+00:00",
    ).model_dump(mode="json")


def write_manifest(folder: Path, *, validate: dict | None, complete: bool = True,
                   verdict: bool | None = None) -> ConversionManifest:
    """A manifest over the folder's real shard hashes; `verdict` True/False adds a sealed passing/failing verdict to
    the `validate` record."""
    reader = CheckpointReader(folder)
    shards = {}
    for file in reader.shard_files:
        data = (folder / file).read_bytes()
        shards[file] = ShardRecord(file=file, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data),
                                   tensors=len(reader.shard_tensors(file)))
    manifest = ConversionManifest(
        source=SourceRecord(path="/models/Kimi-K2.6", repo_id="moonshotai/Kimi-K2.6", revision="main"),
        settings=ConversionSettings(method="int4-aware", kv_cache_quant_algo="FP8"),
        shards=shards, complete=complete,
        tensor_stats={"model.layers.1.mlp.experts.0.gate_proj": {"rel_mse": 0.006, "exact_fraction": 0.8,
                                                                 "max_abs_error": 0.01, "numel": 1024}},
        stages={"calibrate": StageRecord(settings={"data": "builtin", "samples": 8, "seq_len": 64}, complete=True,
                                         finished_at="2026-11-29T08:00:00+00:00", outputs={"input_scales": 42})},
    )
    if validate is not None:
        manifest.stages["validate"] = StageRecord(**validate)
        if verdict is not None:
            manifest.stages["validate"].outputs["verdict"] = sealed_verdict(folder, shards, passed=verdict)
    save_manifest(folder, manifest)
    return manifest


@pytest.fixture(name="write_manifest")
def write_manifest_fixture():
    """`write_manifest(folder, validate=..., complete=...)`: a manifest with the folder's real shard hashes."""
    return write_manifest


@pytest.fixture
def publishable(tiny_int4_checkpoint: Path) -> Path:
    folder = tiny_int4_checkpoint
    (folder / "README.md").write_text(SOURCE_CARD)
    reports = folder / "reports"
    reports.mkdir()
    (reports / "validate_report.json").write_text(json.dumps(VALIDATE_REPORT))
    (reports / "serve_check.json").write_text(json.dumps(SERVE_REPORT))
    (reports / "serve_check.png").write_bytes(PNG_1X1)
    write_manifest(folder, validate={"settings": {"samples": 4}, "complete": True,
                                     "finished_at": "2026-11-29T08:10:00+00:00",
                                     "outputs": {"passed": True, "report_json": "reports/validate_report.json"}},
                   verdict=True)
    return folder


def _load_fake_hub():
    # pytest runs with --import-mode=importlib (pyproject), so test helpers are not importable by name.
    name = "kimi_nvfp4_tests_fake_hub"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("fake_hub.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


FAKE_TOKEN = "hf_FAKEtoken0123456789abcdefSECRET"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A loopback Hub stand-in, with HF_TOKEN set to FAKE_TOKEN and no stored login visible."""
    import huggingface_hub.constants as hf_constants

    # Isolate from any real login, and force the LFS (non-xet) transfer the stand-in speaks.
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    monkeypatch.setattr(hf_constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf_home" / "stored_tokens"))
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    with _load_fake_hub().FakeHub() as fake:
        yield fake
