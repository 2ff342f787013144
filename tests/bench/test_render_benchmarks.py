"""docs/benchmarks.md is generated from bench/results/: the committed page matches its result files, renderers
print what the files record (ratios only within one file), and stale or missing inputs are caught."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # bench/ lives beside the package, not inside it
    sys.path.insert(0, str(REPO_ROOT))

from bench import render_benchmarks as rb  # noqa: E402
from bench.renderers import REGISTRY, BenchmarkRenderError, BlockContext, ResultFile  # noqa: E402

CALIBRATE_RESULT = {
    "device": "NVIDIA H200",
    "samples": 4,
    "seq_len": 128,
    "dtype": "bfloat16",
    "layer_seconds": [1.0, 2.0],
    "dense_layer_seconds": 1.0,
    "moe_layer_seconds": 2.0,
    "moe_layer_tokens_per_second": 256.0,
    "moe_layer_model_tflops_per_s": 100.0,
    "fraction_of_bf16_peak": 0.25,
    "peak_gpu_memory_gib": 3.25,
    "projected_k26_61_layers_512x2048_minutes": 12.34,
    "goal_minutes": 10,
    "projection_from": "2 synthetic layers x 4 sequences x 128 tokens",
    "label": "fixture run",
    "command": "python -m bench.speed.calibrate --samples 4 --json bench/results/cal.json",
}
CALIBRATE_MARKER = "<!-- generated: calibrate_stage_timings (from bench/results/cal.json; command: python bench/x.py) -->"
HAND_WRITTEN_HEAD = "# Page\n\nHand-written prose stays as it is.\n\n"
HAND_WRITTEN_TAIL = "\nMore prose after the block.\n"


def _mini_repo(tmp_path: Path, result: dict = CALIBRATE_RESULT, body: str = "stale text") -> Path:
    """A repository root with one result file and a page holding one generated block."""
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "cal.json").write_text(json.dumps(result))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text(
        HAND_WRITTEN_HEAD + CALIBRATE_MARKER + "\n" + body + "\n" + rb.CLOSE_MARKER + "\n" + HAND_WRITTEN_TAIL
    )
    return tmp_path


def _context(name: str, data, command: str = "python bench/x.py") -> BlockContext:
    return BlockContext(name, (ResultFile(f"bench/results/{name}.json", data),), command)


def test_committed_benchmarks_page_is_what_bench_results_render():
    diff = rb.check_document(REPO_ROOT / rb.DOC_PATH, REPO_ROOT)
    assert diff == "", f"docs/benchmarks.md is stale; run python bench/render_benchmarks.py\n{diff}"


def test_every_block_of_the_committed_page_has_a_renderer_and_existing_result_files():
    blocks = rb.find_blocks((REPO_ROOT / rb.DOC_PATH).read_text())
    assert blocks, "docs/benchmarks.md has no generated block"
    for block in blocks:
        assert block.name in REGISTRY, block.name
        for f in block.files:
            assert (REPO_ROOT / f).is_file(), f"{block.name}: {f} missing"


def test_calibrate_renderer_prints_the_fixture_figures_and_labels_the_projection():
    text = REGISTRY["calibrate_stage_timings"](_context("cal", CALIBRATE_RESULT))
    assert "| `fixture run` | 4 x 128 | bfloat16 | 2.00 | 1.00 | 0.3k | 100 (25 % of 400) | 3.2 | 12.3 (goal 10) |" in text
    assert "**Projected**, not measured" in text
    assert "projected from 2 synthetic layers x 4 sequences x 128 tokens" in text
    # the file records its command, so that one is shown, not the marker's
    assert "command: `python -m bench.speed.calibrate --samples 4 --json bench/results/cal.json`" in text
    assert "device: NVIDIA H200" in text


def test_a_file_without_a_recorded_command_shows_the_markers_command_as_such():
    data = {k: v for k, v in CALIBRATE_RESULT.items() if k != "command"}
    text = REGISTRY["calibrate_stage_timings"](_context("cal", data, command="bash bench/gpu_suite.sh model-stages $OUT"))
    assert "command (not recorded in the file): `bash bench/gpu_suite.sh model-stages $OUT`" in text


CONVERT_RESULT = {
    "device": "cpu", "workers": 1, "layers": 3, "experts": 8, "int4_bytes": 2e9, "tensor_bytes": 4e9,
    "baseline_rss_bytes": 1e9,
    "ours": {"amax": {"seconds": 4.0, "peak_rss_bytes": 1.5e9}, "int4-aware": {"seconds": 8.0, "peak_rss_bytes": 2e9}},
    "peer": {"seconds": 20.0, "peak_rss_bytes": 6e9},
}


def test_convert_ratio_is_taken_against_the_peer_of_the_same_result_file():
    text = REGISTRY["convert_vs_peer"](_context("convert", CONVERT_RESULT))
    # speed x peer = 20 / 4 and 20 / 8; RSS net of the import baseline = 0.5 / 5 and 1 / 5
    assert "| `amax` | 4.00 | 0.500 | 1.000 | 1.50 | 5.00 | 0.10 |" in text
    assert "| `int4-aware` | 8.00 | 0.250 | 0.500 | 2.00 | 2.50 | 0.20 |" in text
    assert "speed x peer (same run)" in text


@pytest.mark.parametrize("peer", [None, {"task": "peer", "error": "llm-compressor is not importable"}])
def test_convert_without_the_peers_figures_shows_no_ratio(peer):
    data = {k: v for k, v in CONVERT_RESULT.items() if k != "peer"}
    if peer is not None:
        data["peer"] = peer
    text = REGISTRY["convert_vs_peer"](_context("convert", data))
    assert "x peer" not in text
    assert "no ratio is shown" in text
    assert "| `amax` | 4.00 | 0.500 | 1.000 | 1.50 |" in text


def test_scale_method_multiple_of_amax_comes_from_the_same_file_or_is_not_shown():
    rows = [
        {"method": "amax", "rel_mse": 0.01, "exact_fraction": 0.12, "params_per_s": 2e7},
        {"method": "int4-aware", "rel_mse": 0.005, "exact_fraction": 0.14, "params_per_s": 1e7},
    ]
    text = REGISTRY["scale_method_quality"](_context("sm", {"device": "cpu", "results": rows, "torch_threads": 1}))
    assert "| `int4-aware` | 0.00500 | 0.500 | 14.0 % | 10.00 |" in text
    assert "Mparams/s (cpu, 1 thread)" in text
    without_amax = REGISTRY["scale_method_quality"](_context("sm", {"device": "cpu", "results": rows[1:]}))
    assert "| `int4-aware` | 0.00500 | — | 14.0 % | 10.00 |" in without_amax


def test_render_rewrites_only_the_blocks(tmp_path):
    root = _mini_repo(tmp_path)
    doc = root / "docs" / "benchmarks.md"
    assert rb.main(["--root", str(root)]) == 0
    text = doc.read_text()
    assert text.startswith(HAND_WRITTEN_HEAD + CALIBRATE_MARKER + "\n")
    assert text.endswith(rb.CLOSE_MARKER + "\n" + HAND_WRITTEN_TAIL)
    assert "stale text" not in text and "`fixture run`" in text
    assert rb.main(["--root", str(root), "--check"]) == 0
    assert rb.render_document(text, root) == text  # rendering is idempotent


def test_a_changed_result_value_makes_check_fail_with_a_diff(tmp_path, capsys):
    root = _mini_repo(tmp_path)
    assert rb.main(["--root", str(root)]) == 0
    changed = dict(CALIBRATE_RESULT, moe_layer_seconds=9.87)
    (root / "bench" / "results" / "cal.json").write_text(json.dumps(changed))
    capsys.readouterr()
    assert rb.main(["--root", str(root), "--check"]) == rb.EXIT_STALE
    out = capsys.readouterr()
    assert "-| `fixture run` | 4 x 128 | bfloat16 | 2.00 |" in out.out
    assert "+| `fixture run` | 4 x 128 | bfloat16 | 9.87 |" in out.out
    assert "run: python bench/render_benchmarks.py" in out.err


def test_a_hand_edited_figure_inside_a_block_makes_check_fail(tmp_path):
    root = _mini_repo(tmp_path)
    rb.main(["--root", str(root)])
    doc = root / "docs" / "benchmarks.md"
    doc.write_text(doc.read_text().replace("| 2.00 |", "| 1.50 |"))
    assert rb.main(["--root", str(root), "--check"]) == rb.EXIT_STALE


def test_a_missing_result_file_is_an_error_naming_it(tmp_path, capsys):
    root = _mini_repo(tmp_path)
    (root / "bench" / "results" / "cal.json").unlink()
    with pytest.raises(BenchmarkRenderError, match=r"bench/results/cal\.json: result file not found"):
        rb.check_document(root / "docs" / "benchmarks.md", root)
    assert rb.main(["--root", str(root), "--check"]) == rb.EXIT_ERROR
    assert "bench/results/cal.json" in capsys.readouterr().err


def test_a_result_file_lacking_a_figure_is_an_error_naming_file_and_field(tmp_path):
    root = _mini_repo(tmp_path, result={k: v for k, v in CALIBRATE_RESULT.items() if k != "moe_layer_seconds"})
    with pytest.raises(BenchmarkRenderError, match=r"bench/results/cal\.json: result file lacks moe_layer_seconds"):
        rb.check_document(root / "docs" / "benchmarks.md", root)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- generated: calibrate_stage_timings (from bench/results/cal.json) -->\n<!-- /generated -->\n",
         "malformed marker"),
        (CALIBRATE_MARKER + "\nbody\n", "has no closing"),
        ("text\n<!-- /generated -->\n", "without an opening marker"),
        (CALIBRATE_MARKER + "\n" + CALIBRATE_MARKER + "\n<!-- /generated -->\n", "opens inside block"),
        ("<!-- generated: no_such_table (from bench/results/cal.json; command: x) -->\n<!-- /generated -->\n",
         "no renderer of that name"),
    ],
)
def test_malformed_markers_are_refused(tmp_path, text, message):
    root = _mini_repo(tmp_path)
    with pytest.raises(BenchmarkRenderError, match=message):
        rb.render_document(text, root)


def test_an_indented_marker_is_text_not_a_block(tmp_path):
    text = "    " + CALIBRATE_MARKER + "\n    <!-- /generated -->\n"
    assert rb.find_blocks(text) == []


def test_shared_expert_bytes_arithmetic_matches_k26_dimensions():
    from bench.experiments.shared_experts.bytes import k26_bytes

    cfg = {"hidden_size": 7168, "num_hidden_layers": 61, "first_k_dense_replace": 1, "moe_intermediate_size": 2048,
           "intermediate_size": 18432, "n_shared_experts": 1, "n_routed_experts": 384, "num_experts_per_tok": 8,
           "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "v_head_dim": 128}
    record = k26_bytes(cfg, vocab_size=163840)
    per_layer = 3 * 7168 * 2048
    assert record["shared_expert_weights_per_layer"] == per_layer
    assert record["shared_experts_bytes"]["bf16"] == 60 * per_layer * 2
    assert record["shared_experts_bytes"]["nvfp4"] == 60 * (per_layer * (0.5 + 1 / 16) + 6 * 4)
    assert record["per_token_read_bytes_parts"]["lm_head_bf16"] == 163840 * 7168 * 2
    saved = record["per_token_read_bytes"]["bf16"] - record["per_token_read_bytes"]["nvfp4"]
    assert saved == record["shared_experts_bytes"]["bf16"] - record["shared_experts_bytes"]["nvfp4"]


def _vs_modelopt_summary(row: str, kl16: float, kl4: float, best16: float, best4: float, met: bool | None) -> dict:
    entry = lambda v: {"mean": v, "min": v * 0.9, "max": v * 1.1}  # noqa: E731
    s = {"row": row, "seeds": [1, 2], "w4a16.kl_mean": entry(kl16), "w4a4.kl_mean": entry(kl4),
         "w4a16.kl_p99": entry(0.1), "w4a16.top1": entry(0.95), "w4a4.top1": entry(0.93),
         "ratio_to_best_modelopt": {"w4a16.kl_mean": {"ratio": kl16 / best16, "best": "modelopt:LH"},
                                    "w4a4.kl_mean": {"ratio": kl4 / best4, "best": "modelopt:LH"}}}
    if met is not None:
        s["goal_kl_met"] = met
    return s


def test_vs_modelopt_renderer_shows_multiples_of_the_best_recipe_and_failed_or_inert_recipes():
    data = {
        "command": "python -m bench.quality.vs_modelopt --seeds 1 2",
        "settings": {"heldout": {"samples": 16, "seq_len": 256, "seeds": [1, 2]}, "goal_kl_ratio": 0.8},
        "modelopt": {"LH": {"seconds": 1.0}, "AWQ": {"seconds": 1.0, "weights_identical_to": "DEFAULT"},
                     "BAD": {"seconds": 1.0, "error": "RuntimeError: boom"}},
        "summary": [_vs_modelopt_summary("gptq", 0.006, 0.02, 0.01, 0.025, True),
                    _vs_modelopt_summary("modelopt:LH", 0.01, 0.025, 0.01, 0.025, None)],
    }
    text = REGISTRY["accuracy_vs_modelopt"](_context("accuracy_vs_modelopt", data))
    assert "| `gptq` | 0.0060 (0.0054–0.0066) | 0.60x | 0.0200 (0.0180–0.0220) | 0.80x |" in text
    assert "| Model Optimizer `LH` | 0.0100 (0.0090–0.0110) | 1.00x |" in text
    assert "met by `gptq`" in text
    assert "`BAD` failed on this model, no row: RuntimeError: boom" in text
    assert "`AWQ` exported weights byte-identical to `DEFAULT`'s" in text


def test_ours_only_renderer_shows_multiples_of_amax_and_gptq_and_paired_draws():
    def row(name, seed, kl16, kl4):
        return {"row": name, "seed": seed, "w4a16": {"kl_mean": kl16}, "w4a4": {"kl_mean": kl4}}

    data = {
        "command": "python -m bench.quality.vs_modelopt --ours-only --seeds 1 2",
        "settings": {"heldout": {"samples": 16, "seq_len": 256, "seeds": [1, 2]}},
        "rows": [row("amax", 1, 0.02, 0.04), row("gptq", 1, 0.01, 0.03), row("new", 1, 0.012, 0.02),
                 row("amax", 2, 0.02, 0.04), row("gptq", 2, 0.01, 0.03), row("new", 2, 0.012, 0.035)],
        "summary": [_vs_modelopt_summary("amax", 0.02, 0.04, 0.9, 0.9, None),
                    _vs_modelopt_summary("gptq", 0.01, 0.03, 0.95, 0.93, None),
                    _vs_modelopt_summary("new", 0.012, 0.0275, 0.94, 0.94, None)],
    }
    text = REGISTRY["accuracy_ours_paired"](_context("ours", data))
    assert "| `gptq` | 0.0100 (0.0090–0.0110) | 0.50x | 1.00x | 0.0300 (0.0270–0.0330) | 0.75x | 1.00x | — |" in text
    assert "| `new` | 0.0120 (0.0108–0.0132) | 0.60x | 1.20x | 0.0275 (0.0248–0.0303) | 0.69x | 0.92x | 1 of 2 |" in text


def test_w4a4_layer_error_renderer_shows_in_sample_and_other_tokens_multiples():
    rows = [{"statistics": w, "input": g, "mode": m, "method": meth, "error": 1.0, "vs_int4_aware": v}
            for w in ("in-sample", "other tokens") for g in ("gate_up", "down") for m in ("w4a4", "w4a16")
            for meth, v in (("int4-aware", 1.0), ("new", 0.5 if w == "in-sample" else 1.25))]
    data = {"command": "python -m bench.experiments.w4a4_floor.layer_error", "rows": rows,
            "settings": {"fitted_seed": 0, "other_seed": 1, "samples": 16, "seq_len": 256, "sequences_shared": 0}}
    text = REGISTRY["w4a4_layer_error"](_context("layer_error", data))
    assert "| `new` | 0.500 | 1.250 | 0.500 | 1.250 | 0.500 | 1.250 | 0.500 | 1.250 |" in text
    assert "calibrate seed 0 (fitted on) and seed 1 (16 × 256 tokens each, 0 sequences shared)" in text


def test_w4a4_floor_renderer_shows_multiples_of_amax_and_marks_the_bounds():
    def entry(name, kl4, ratio, meets, kl16=None):
        spread = lambda v: {"mean": v, "min": v * 0.9, "max": v * 1.1}  # noqa: E731
        out = {"row": name, "w4a4.kl_mean": spread(kl4), "w4a4.top1": spread(0.93), "w4a4_kl_vs_amax": ratio,
               "meets_w4a4_goal": meets}
        if kl16 is not None:
            out["w4a16.kl_mean"] = spread(kl16)
        return out

    data = {"command": "python -m bench.experiments.w4a4_floor.floor --seeds 1 2",
            "settings": {"heldout": {"samples": 16, "seq_len": 256, "seeds": [1, 2]}, "goal_w4a4_ratio": 0.62},
            "summary": [entry("amax", 0.04, 1.0, False, 0.02),
                        entry("exact weights, all inputs quantized (floor)", 0.02, 0.5, True),
                        entry("mse weights", 0.03, 0.75, False, 0.015)]}
    text = REGISTRY["w4a4_floor"](_context("floor", data))
    assert "issue 16's goal: ≤ 0.62x" in text
    assert "| `amax` | 0.0400 (0.0360–0.0440) | 1.00x | 0.0200 (0.0180–0.0220) | 0.930 | no |" in text
    assert "| `exact weights, all inputs quantized (floor)` | 0.0200 (0.0180–0.0220) | 0.50x | — | 0.930 | (bound) |" in text
    assert "| `mse weights` | 0.0300 (0.0270–0.0330) | 0.75x | 0.0150 (0.0135–0.0165) | 0.930 | no |" in text


def test_gptq_solver_timing_renderer_shows_each_run_and_its_commit():
    data = {"command": "python -m bench.profile.gptq --kind down", "kind": "down", "experts": 16, "factor_s": 0.05,
            "gptq_quantize_s": 0.25, "s_per_expert": 0.015625, "projected_s_per_384_experts": 6.0,
            "git_commit": "98f85ea0123"}
    text = REGISTRY["gptq_solver_timing"](_context("profile", data))
    assert "| `profile` | down (reads the SwiGLU output, 2048 wide) | 16 | `98f85ea` | 0.050 | 0.250 | 0.0156 | 6.0 |" in text
    with pytest.raises(BenchmarkRenderError, match="lacks factor_s"):
        REGISTRY["gptq_solver_timing"](_context("profile", {k: v for k, v in data.items() if k != "factor_s"}))


def test_gptq_levers_renderer_shows_layer_errors_and_multiples_of_gptq():
    def entry(name, kl16, kl4, layer):
        spread = lambda v: {"mean": v, "min": v, "max": v}  # noqa: E731
        return {"row": name, "w4a16.kl_mean": spread(kl16), "w4a4.kl_mean": spread(kl4), "w4a16.top1": spread(0.96),
                "layer_error_other_tokens_vs_int4_aware": {"gate_up.w4a16": layer, "down.w4a16": 1.0,
                                                           "gate_up.w4a4": 1.0, "down.w4a4": 1.0}}

    data = {"command": "python -m bench.experiments.gptq_levers.levers", "summary": [
                entry("int4-aware", 0.012, 0.03, 1.0), entry("gptq", 0.008, 0.025, 0.6),
                entry("gptq, damping x10", 0.010, 0.025, 0.55)],
            "settings": {"heldout": {"samples": 16, "seq_len": 256, "seeds": [1]}, "other_seed": 1}}
    text = REGISTRY["gptq_levers"](_context("levers", data))
    assert "| `gptq, damping x10` | 0.550 | 1.000 | 1.000 | 1.000 | 0.0100 (0.0100–0.0100) | 1.25x |" in text
    assert "other calibration tokens (seed 1)" in text


def test_traffic_window_renderer_prints_each_recorded_path_and_skips_absent_ones():
    mode = {"requests_per_s": 12345.6, "peak_rss_over_imports_mib": 42.0, "peak_rss_mib": 300.5}
    data = {"device": "cpu (2 cores)", "command": "python -m bench.speed.traffic_import --window",
            "settings": {"requests": 20000}, "folder": {"mib": 12.3}, "read_streaming": mode,
            "read_all": {**mode, "peak_rss_over_imports_mib": 400.0}, "window_streaming": mode}
    out = REGISTRY["traffic_window_memory"](_context("traffic_window_memory", data))
    assert "| 20 000 | 12.3 | read + group + window + pick, bounded" in out
    assert "400.0" in out and "12.3k" in out
    assert "in memory (data/windows.py)" not in out  # the file has no in-memory run
