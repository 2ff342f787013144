"""`kimi-nvfp4 data ...`: write agent sessions, list the --data kinds, measure (`stats`) and export (`export`) what
a --data spec renders to."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .agent_sessions import DEFAULT_MAX_TURNS, DEFAULT_SESSIONS, DEFAULT_THINKING_PROB
from .spec_option import data_option


@click.group("data")
def data_command() -> None:
    """Coding-agent session data: generate it, inspect what it tokenizes to."""


@data_command.command("sessions")
@click.option("--tree", "tree", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Source tree to build sessions over (default: Python stdlib json/email/asyncio).")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="JSONL file to write (OpenAI chat format, one session per line).")
@click.option("-n", "--sessions", "n", type=click.IntRange(min=1), default=DEFAULT_SESSIONS, show_default=True,
              help="How many sessions to write.")
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same tree -> same sessions.")
@click.option("--max-turns", type=click.IntRange(min=1), default=DEFAULT_MAX_TURNS, show_default=True,
              help="Most user requests per session.")
@click.option("--thinking-prob", type=click.FloatRange(0, 1), default=DEFAULT_THINKING_PROB, show_default=True,
              help="Chance an assistant message carries reasoning_content.")
@click.option("--execute/--no-execute", default=None,
              help="Run doctests of the patched module in a sandbox (default: on for the stdlib, off for --tree).")
def sessions_command(tree: Path | None, out: Path, n: int, seed: int, max_turns: int, thinking_prob: float,
                     execute: bool | None) -> None:
    """Generate agent sessions with real file contents, grep output and test output."""
    from .agent_sessions import generate_agent_sessions
    from .loaders import save_jsonl

    convs = generate_agent_sessions(tree, n=n, seed=seed, max_turns=max_turns, thinking_prob=thinking_prob,
                                    execute=execute, progress=True)
    save_jsonl(convs, out)
    click.echo(f"wrote {len(convs)} sessions to {out}")


@data_command.command("sources")
def sources_command() -> None:
    """List the registered --data kinds (data/sources/): how each is written, whether its tokens are as served
    or re-rendered with the checkpoint's chat template, and its options."""
    from .source_registry import DATA_SOURCES

    for s in DATA_SOURCES.entries():
        options = ", ".join(f"{k}={f.default!r}" for k, f in s.options_model.model_fields.items()) or "none"
        click.echo(f"{s.usage:<18} {s.provenance:<12} {s.description} (options: {options})")


def _split_windows(data: str, checkpoint: Path, seq_len: int, heldout_fraction: float, preserve_thinking: bool,
                   max_bad_fraction: float):
    from .loaders import load_data_spec
    from .source_registry import check_bad_fraction
    from .tokenizer import load_tokenizer
    from .windows import check_vocabulary, checkpoint_vocab_size, split_windows

    results = load_data_spec(data)
    check_bad_fraction(results, max_bad_fraction)
    windows = split_windows(results, load_tokenizer(checkpoint), seq_len, heldout_fraction=heldout_fraction,
                            preserve_thinking=preserve_thinking)
    vocab_size = checkpoint_vocab_size(checkpoint)
    if vocab_size is not None:
        for name, part in (("calibration", windows.calibration), ("heldout", windows.heldout)):
            check_vocabulary(part.sequences, vocab_size, data=data, where=name)
    return results, windows


_COMMON = [
    click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
                 help="Checkpoint folder whose tokenizer and chat template render the data."),
    click.option("--seq-len", type=click.IntRange(min=2), default=2048, show_default=True),
    click.option("--heldout-fraction", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.2,
                 show_default=True),
    click.option("--preserve-thinking", is_flag=True,
                 help="Render sessions with every turn's reasoning (K2.6's preserve_thinking); default: as served."),
    click.option("--max-bad-fraction", type=click.FloatRange(0, 1), default=0.01, show_default=True,
                 help="Refuse a source with more unreadable records than this fraction."),
]


def _common(f):
    for option in reversed(_COMMON):
        f = option(f)
    return data_option("Data to render.")(f)


@data_command.command("stats")
@_common
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the statistics as JSON here.")
def stats_command(data: str, checkpoint: Path, seq_len: int, heldout_fraction: float, preserve_thinking: bool,
                  max_bad_fraction: float, json_out: Path | None) -> None:
    """Per source: records read, skipped (counted by reason), requests, conversations; then the calibration and
    held-out windows (held-out disjoint from calibration) and the unique-token fraction. Counts only: no text
    or token id of the data is printed."""
    from .stats import data_stats_report, write_json

    results, windows = _split_windows(data, checkpoint, seq_len, heldout_fraction, preserve_thinking,
                                      max_bad_fraction)
    report = data_stats_report(results, windows, seq_len=seq_len, preserve_thinking=preserve_thinking)
    text = json.dumps(report, indent=2)
    if json_out is not None:
        write_json(json_out, report)
    click.echo(text)


@data_command.command("export")
@_common
@click.option("--samples", type=click.IntRange(min=1), default=None,
              help="Full --seq-len windows per part, picked as calibrate/validate pick them with --seed (fewer is "
                   "an error, as in the stages); default: every window, shorter ones included.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help='JSONL to write: {"split": "calibration"|"heldout", "ids": [...]} per window.')
def export_command(data: str, checkpoint: Path, seq_len: int, heldout_fraction: float, preserve_thinking: bool,
                   max_bad_fraction: float, samples: int | None, seed: int, out: Path) -> None:
    """Write the exact token-id windows calibrate and validate use, so you can see what goes in."""
    from .stats import pick, write_windows

    _, windows = _split_windows(data, checkpoint, seq_len, heldout_fraction, preserve_thinking, max_bad_fraction)
    parts = {name: pick(part.sequences, samples, seed, seq_len=seq_len, data=data, part=name)
             for name, part in (("calibration", windows.calibration), ("heldout", windows.heldout))}
    write_windows(out, parts)
    click.echo(f"wrote {sum(len(v) for v in parts.values())} windows to {out} "
               f"({len(parts['calibration'])} calibration, {len(parts['heldout'])} held-out)")
