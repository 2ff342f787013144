"""Our scale methods against Model Optimizer's own NVFP4 recipes in one run (bench.quality.vs_modelopt): KL,
top-1 and the multiple of the best Model Optimizer recipe, all taken within the one result file."""

from __future__ import annotations

from .common import MISSING, BlockContext, num, provenance, renderer, table
from .quality import _rows, _spread

MODELOPT_PREFIX = "modelopt:"
MODES = ("w4a16", "w4a4")


def _name(row: str) -> str:
    return f"Model Optimizer `{row[len(MODELOPT_PREFIX):]}`" if row.startswith(MODELOPT_PREFIX) else f"`{row}`"


def _ratio(s: dict, key: str) -> str:
    r = s.get("ratio_to_best_modelopt", {}).get(key)
    return num(r["ratio"], 2, "x") if r else MISSING


def _recipe_notes(records: dict) -> list[str]:
    notes = []
    for recipe, rec in records.items():
        if "error" in rec:
            notes.append(f"Model Optimizer `{recipe}` failed on this model, no row: {rec['error']}")
        elif rec.get("weights_identical_to"):
            notes.append(f"Model Optimizer `{recipe}` exported weights byte-identical to "
                         f"`{rec['weights_identical_to']}`'s (its algorithm did not change the fused experts).")
    return notes


@renderer("accuracy_vs_modelopt")
def accuracy_vs_modelopt(ctx: BlockContext) -> str:
    parts = [provenance(ctx)]
    for r in ctx.results:
        r.require("settings", "modelopt")
        summary = _rows(r, "summary")
        held = r.data["settings"].get("heldout", {})
        best = {m: next((s["ratio_to_best_modelopt"][f"{m}.kl_mean"]["best"] for s in summary
                         if "ratio_to_best_modelopt" in s), None) for m in MODES}
        parts.append(
            f"`{r.path}` — held-out draws (seeds) {', '.join(map(str, held.get('seeds', [])))} of "
            f"{held.get('samples', MISSING)} × {held.get('seq_len', MISSING)} tokens; mean (min–max) over the draws; "
            f"x best = multiple of the best Model Optimizer recipe's mean KL in this run (W4A16: "
            f"{_name(best['w4a16']) if best['w4a16'] else MISSING}, W4A4: "
            f"{_name(best['w4a4']) if best['w4a4'] else MISSING}):")
        parts.append(table(
            ["row", "KL W4A16", "x best", "KL W4A4", "x best", "KL p99 W4A16", "top-1 W4A16", "top-1 W4A4"],
            [[_name(s["row"]), _spread(s["w4a16.kl_mean"], 4), _ratio(s, "w4a16.kl_mean"), _spread(s["w4a4.kl_mean"], 4),
              _ratio(s, "w4a4.kl_mean"), num(s["w4a16.kl_p99"]["mean"], 3), num(s["w4a16.top1"]["mean"], 3),
              num(s["w4a4.top1"]["mean"], 3)] for s in summary],
        ))
        goal = r.data["settings"].get("goal_kl_ratio")
        met = [f"`{s['row']}`" for s in summary if s.get("goal_kl_met")]
        ours = [s for s in summary if not s["row"].startswith(MODELOPT_PREFIX)]
        if goal is not None and ours:
            parts.append(f"Goal KL ≤ {goal}x the best Model Optimizer recipe in both modes: "
                         + (f"met by {', '.join(met)}." if met else "met by none of our methods in this run."))
        parts += _recipe_notes(r.data["modelopt"])
    return "\n\n".join(parts)


def _multiple(s: dict, base: dict | None, key: str) -> str:
    return num(s[key]["mean"] / base[key]["mean"], 2, "x") if base else MISSING


@renderer("accuracy_ours_paired")
def accuracy_ours_paired(ctx: BlockContext) -> str:
    """Our methods alone on the vs-Model-Optimizer draws (bench.quality.vs_modelopt --ours-only): KL and top-1,
    the multiple of `amax` and of `gptq` (taken within the file), and per draw whether a row's W4A4 KL is below
    gptq's on the same draw (paired: the draw-to-draw spread is larger than the differences between methods)."""
    parts = [provenance(ctx)]
    for r in ctx.results:
        summary = _rows(r, "summary")
        rows = _rows(r, "rows")
        by_name = {s["row"]: s for s in summary}
        amax, gptq = by_name.get("amax"), by_name.get("gptq")
        gptq_w4a4 = {row["seed"]: row["w4a4"]["kl_mean"] for row in rows if row["row"] == "gptq"}

        def below_gptq(name: str) -> str:
            mine = {row["seed"]: row["w4a4"]["kl_mean"] for row in rows if row["row"] == name}
            seeds = sorted(set(mine) & set(gptq_w4a4))
            if not seeds or name == "gptq":
                return MISSING
            return f"{sum(mine[s] < gptq_w4a4[s] for s in seeds)} of {len(seeds)}"

        held = r.data.get("settings", {}).get("heldout", {})
        parts.append(
            f"`{r.path}` — held-out draws (seeds) {', '.join(map(str, held.get('seeds', [])))} of "
            f"{held.get('samples', MISSING)} × {held.get('seq_len', MISSING)} tokens; mean (min–max) over the draws:")
        parts.append(table(
            ["row", "KL W4A16", "x amax", "x gptq", "KL W4A4", "x amax", "x gptq", "draws W4A4 < gptq",
             "top-1 W4A16", "top-1 W4A4"],
            [[_name(s["row"]), _spread(s["w4a16.kl_mean"], 4), _multiple(s, amax, "w4a16.kl_mean"),
              _multiple(s, gptq, "w4a16.kl_mean"), _spread(s["w4a4.kl_mean"], 4), _multiple(s, amax, "w4a4.kl_mean"),
              _multiple(s, gptq, "w4a4.kl_mean"), below_gptq(s["row"]), num(s["w4a16.top1"]["mean"], 3),
              num(s["w4a4.top1"]["mean"], 3)] for s in summary],
        ))
    return "\n\n".join(parts)


FLOOR_ROW_PREFIX = "exact weights"  # bench_w4a4_floor.floor_rows: bounds with no weight error, not methods


def _goal_cell(s: dict) -> str:
    if s["row"].startswith(FLOOR_ROW_PREFIX):
        return "(bound)"
    return "yes" if s["meets_w4a4_goal"] else "no"


@renderer("w4a4_floor")
def w4a4_floor(ctx: BlockContext) -> str:
    """bench.experiments.w4a4_floor.floor: W4A4 KL of the checkpoints, of the exact-weight floor and of the activation-side
    transforms, each as a multiple of `amax`'s W4A4 KL in the same file, against issue 16's goal."""
    parts = [provenance(ctx)]
    for r in ctx.results:
        r.require("settings")
        summary = _rows(r, "summary")
        held = r.data["settings"].get("heldout", {})
        goal = r.data["settings"].get("goal_w4a4_ratio")
        parts.append(
            f"`{r.path}` — held-out draws (seeds) {', '.join(map(str, held.get('seeds', [])))} of "
            f"{held.get('samples', MISSING)} × {held.get('seq_len', MISSING)} tokens; mean (min–max) over the draws; "
            f"x amax = multiple of `amax`'s mean W4A4 KL in this run (issue 16's goal: ≤ {num(goal, 2, 'x')}):")
        parts.append(table(
            ["row", "KL W4A4", "x amax", "KL W4A16 (same weights)", "top-1 W4A4", f"≤ {num(goal, 2, 'x')} amax"],
            [[f"`{s['row']}`", _spread(s["w4a4.kl_mean"], 4), num(s["w4a4_kl_vs_amax"], 2, "x"),
              _spread(s["w4a16.kl_mean"], 4) if "w4a16.kl_mean" in s else MISSING,
              num(s["w4a4.top1"]["mean"], 3), _goal_cell(s)] for s in summary],
        ))
    return "\n\n".join(parts)


@renderer("gptq_levers")
def gptq_levers(ctx: BlockContext) -> str:
    """bench.experiments.gptq_levers.levers: per gptq variant, its layer errors on other tokens (multiple of int4-aware's) and
    validate's KL / top-1 over the draws, with the KL as a multiple of plain `gptq`'s in the same file."""
    parts = [provenance(ctx)]
    for r in ctx.results:
        r.require("settings")
        summary = _rows(r, "summary")
        held = r.data["settings"].get("heldout", {})
        gptq = next((s for s in summary if s["row"] == "gptq"), None)
        parts.append(
            f"`{r.path}` — layer errors under other calibration tokens (seed {r.data['settings'].get('other_seed')}), "
            f"summed over experts with dense statistics, multiple of int4-aware's; KL and top-1 over held-out draws "
            f"(seeds) {', '.join(map(str, held.get('seeds', [])))} of {held.get('samples', MISSING)} × "
            f"{held.get('seq_len', MISSING)} tokens, mean (min–max):")
        groups = ("gate_up.w4a16", "down.w4a16", "gate_up.w4a4", "down.w4a4")
        parts.append(table(
            ["row", *(f"layer error {g.replace('.', ' ').upper().replace('GATE_UP', 'gate/up').replace('DOWN', 'down')}"
                      for g in groups),
             "KL W4A16", "x gptq", "KL W4A4", "x gptq", "top-1 W4A16"],
            [[f"`{s['row']}`", *(num(s["layer_error_other_tokens_vs_int4_aware"].get(g), 3) for g in groups),
              _spread(s["w4a16.kl_mean"], 4), _multiple(s, gptq, "w4a16.kl_mean"), _spread(s["w4a4.kl_mean"], 4),
              _multiple(s, gptq, "w4a4.kl_mean"), num(s["w4a16.top1"]["mean"], 3)] for s in summary],
        ))
    return "\n\n".join(parts)
