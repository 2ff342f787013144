"""bench/experiments/gptq_levers/pool_order.py: --variants picks the rows, --measure-references the references (the
checkpoints, layer errors and held-out figures stubbed: no model runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.experiments.gptq_levers import pool_order

POOL256 = "gptq, pool_tokens 256"


def test_variants_default_to_all_in_order_and_unknown_names_list_the_valid_ones():
    assert pool_order.selected_variants(None) == pool_order.selected_variants([]) == pool_order.variant_names()
    assert pool_order.variant_names()[:2] == ["int4-aware", "gptq"]
    assert pool_order.selected_variants([POOL256, "gptq"]) == ["gptq", POOL256]
    with pytest.raises(ValueError, match=r"unknown variant\(s\) 'pool 256'; valid: 'int4-aware', 'gptq', "):
        pool_order.selected_variants(["gptq", "pool 256"])


def _stub(monkeypatch, tmp_path, argv: list[str]) -> list[tuple]:
    calls: list[tuple] = []
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # pool_order.FLOOR_FILE is relative to the repository

    def requantized(work, name, base, options=None):
        calls.append(("requantize", name, options))
        return work / name

    monkeypatch.setattr(pool_order, "_calibrated", lambda work, name, *a, **k: work / name)
    monkeypatch.setattr(pool_order, "_requantized", requantized)
    monkeypatch.setattr(pool_order, "expert_layer_errors", lambda other, cps: {
        f"{g}.{m}.{n}": 1.0 + i for i, n in enumerate(cps) for g in ("gate_up", "down") for m in ("w4a4", "w4a16")})
    monkeypatch.setattr(pool_order, "heldout_sequences", lambda base, data, *, samples, seq_len, seed: seed)

    def figures(cps, source, seed):
        calls.append(("heldout", seed, list(cps)))
        return {n: {m: {"kl_mean": 0.01 * seed / (1 + i), "kl_p99": 0.1, "top1": 0.9, "ppl_ratio": 1.0}
                    for m in ("w4a16", "w4a4")} for i, n in enumerate(cps)}

    monkeypatch.setattr(pool_order, "heldout_figures", figures)
    monkeypatch.setattr(pool_order, "measure_references", lambda args: {
        s: {"amax_w4a16": 0.02 * s, "amax_w4a4": 0.05 * s, "floor": 0.001 * s,
            "amax": {"w4a16": {"kl_mean": 0.02 * s}, "w4a4": {"kl_mean": 0.05 * s}}} for s in args.seeds})
    monkeypatch.setattr(sys, "argv", ["pool_order.py", "--work-dir", str(tmp_path / "work"),
                                      "--json", str(tmp_path / "out.json"), *argv])
    return calls


def test_variants_and_measured_references_on_draws_the_floor_file_lacks(monkeypatch, tmp_path, capsys):
    calls = _stub(monkeypatch, tmp_path, ["--seeds", "5", "6", "--variants", "gptq", POOL256])
    with pytest.raises(SystemExit):  # draws 5, 6 are not in the floor file
        pool_order.main()
    assert "pass --measure-references" in capsys.readouterr().err
    sys.argv.append("--measure-references")
    pool_order.main()
    assert [c for c in calls if c[0] == "requantize"] == [("requantize", "gptq", None),
                                                          ("requantize", "lever1", {"pool_tokens": 256})]
    assert [c for c in calls if c[0] == "heldout"] == [("heldout", s, ["gptq", POOL256]) for s in (5, 6)]
    record = json.loads((tmp_path / "out.json").read_text())
    assert record["command"].endswith("--variants gptq 'gptq, pool_tokens 256' --measure-references")  # re-runnable
    assert record["settings"]["variants"] == ["gptq", POOL256]
    assert record["settings"]["method_options"] == {POOL256: {"pool_tokens": 256}}
    assert [(r["row"], r["seed"]) for r in record["rows"]] == [("gptq", 5), (POOL256, 5), ("gptq", 6), (POOL256, 6)]
    assert record["reference_draws"]["5"] == {"amax_w4a16": 0.1, "amax_w4a4": 0.25, "floor": 0.005}
    assert [r["seed"] for r in record["amax_rows"]] == [5, 6]
    assert record["rows"][1]["w4a16_kl_vs_amax"] == pytest.approx(0.025 / 0.1)
    pool = record["summary"][1]
    assert pool["row"] == POOL256 and pool["draws_better_than_gptq"] == {"w4a16": 2, "w4a4": 2}


def test_default_runs_every_row_and_records_no_variants(monkeypatch, tmp_path):
    calls = _stub(monkeypatch, tmp_path, ["--seeds", "1"])  # draw 1 is in the floor file
    pool_order.main()
    assert [c for c in calls if c[0] == "heldout"] == [("heldout", 1, pool_order.variant_names())]
    record = json.loads((tmp_path / "out.json").read_text())
    assert "--variants" not in record["command"] and "variants" not in record["settings"]
    assert record["settings"]["reference"]["file"] == str(pool_order.FLOOR_FILE)
