"""The model card: Hub metadata carried from the source, and every section the issue asks for."""

from __future__ import annotations

import re

import yaml

from kimi_nvfp4.publish import build_model_card, check_publishable
from kimi_nvfp4.publish.card import GENERATED_MARKER


def _split(card: str) -> tuple[dict, str]:
    match = re.match(r"\A---\n(.*?)\n---\n(.*)\Z", card, re.DOTALL)
    assert match, "card must start with YAML front matter"
    return yaml.safe_load(match.group(1)), match.group(2)


def test_front_matter_carries_base_model_and_license(publishable):
    card = build_model_card(publishable, "me/Kimi-K2.6-NVFP4", check_publishable(publishable, progress=False))
    meta, _ = _split(card)
    assert meta["base_model"] == ["moonshotai/Kimi-K2.6"]  # from the manifest's source record
    assert meta["base_model_relation"] == "quantized"
    assert meta["license"] == "other" and meta["license_name"] == "modified-mit"  # from the source card
    assert meta["license_link"] == "LICENSE"
    assert meta["tags"] == ["nvfp4", "modelopt", "sglang", "kimi", "moe"]
    assert meta["pipeline_tag"] == "text-generation"
    assert meta["library_name"]


def test_body_has_every_section(publishable):
    card = build_model_card(publishable, "me/Kimi-K2.6-NVFP4", check_publishable(publishable, progress=False))
    _, body = _split(card)
    assert GENERATED_MARKER in body
    for heading in ("# Kimi-K2.6-NVFP4", "## Precision", "## Method", "## Calibration", "## Validation",
                    "## Serving check", "## Usage"):
        assert heading in body, heading
    # precision split: routed experts and the BF16 parts are separate rows (shard headers)
    assert "| routed experts |" in body and "| MLA attention | BF16 |" in body and "| lm_head | BF16 |" in body
    # method and its error statistics from the manifest
    assert "`int4-aware`" in body and "relative MSE 6.000e-03" in body and "80.0%" in body
    # calibration settings from stages.calibrate
    assert "| samples | `8` |" in body and "| data | `builtin` |" in body
    # validation: end-to-end metrics and gates from the report; local paths stay out of the card
    assert "| w4a4 | 256 | 0.0123 | 0.05 | 0.97 | 5.1 | 5.2 | 1.02 |" in body
    assert "| w4a4.kl_mean | 0.0123 | <= 0.05 | pass |" in body and "Structure checks: 1/1 passed" in body
    assert "/local/path" not in body
    # serve-check: the load sweep, quality, gates (a `|` in a gate name must not break the table), chart
    assert "| 4 | 12 | 0 | 0.25 | 14 | 71.4 | 5.2e+04 | 0.91 |" in body
    assert "| HumanEval pass@1 | 0.667 (3 problems) |" in body
    assert "| mean \\|dlogprob\\| vs emulator | 0.01 | <= 0.25 | pass |" in body
    assert "![Serving check](reports/serve_check.png)" in body
    # launch commands
    assert "sglang.launch_server --model-path me/Kimi-K2.6-NVFP4" in body and "--quantization modelopt_fp4" in body
    assert "--moe-runner-backend flashinfer_trtllm" in body and "--kv-cache-dtype fp8_e4m3" in body
    assert "vllm serve me/Kimi-K2.6-NVFP4" in body
    assert "--force-unvalidated" not in body


def test_forced_card_says_so_first(publishable, write_manifest):
    (publishable / "reports" / "validate_report.json").unlink()
    write_manifest(publishable, validate=None)
    card = build_model_card(publishable, "me/x", check_publishable(publishable, force_unvalidated=True,
                                                                   progress=False))
    _, body = _split(card)
    warning = body.index("published with `--force-unvalidated`")
    assert warning < body.index("## Precision")
    assert "validate has not run" in body
    assert "No validation report was found." in body


def test_license_falls_back_to_other_without_source_card(publishable):
    (publishable / "README.md").unlink()
    card = build_model_card(publishable, "me/x", check_publishable(publishable, progress=False),
                            base_model="org/base")
    meta, _ = _split(card)
    assert meta["license"] == "other" and "license_name" not in meta
    assert meta["base_model"] == ["org/base"]
