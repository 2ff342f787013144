"""`kimi-nvfp4 data ...`: write agent sessions to JSONL, and measure what a --data spec renders to."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .agent_sessions import DEFAULT_MAX_TURNS, DEFAULT_SESSIONS, DEFAULT_THINKING_PROB


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


@data_command.command("stats")
@click.option("--data", "data", required=True,
              help="jsonl:PATH | PATH.jsonl | hf:NAME[:SPLIT] | tree:PATH | builtin | sample (comma-separated).")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
              help="Checkpoint folder whose tokenizer and chat template render the sessions.")
@click.option("--seq-len", type=click.IntRange(min=1), default=2048, show_default=True)
@click.option("--heldout-fraction", type=click.FloatRange(0, 1), default=0.2, show_default=True)
@click.option("--preserve-thinking", is_flag=True,
              help="Render prompts with every turn's reasoning (K2.6's preserve_thinking); default: as served.")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the statistics as JSON here.")
def stats_command(data: str, checkpoint: Path, seq_len: int, heldout_fraction: float, preserve_thinking: bool,
                  json_out: Path | None) -> None:
    """Load --data, split calibration/held-out, render each part's served requests with the checkpoint's
    template into distinct windows (held-out disjoint from calibration); print token counts."""
    from .loaders import load_data_spec
    from .render import render_sessions_with_stats, split_heldout
    from .tokenizer import load_tokenizer

    results = load_data_spec(data)
    convs = list({c.id: c for r in results for c in r.conversations}.values())
    tokenizer = load_tokenizer(checkpoint)
    calibration, heldout = split_heldout(convs, heldout_fraction)
    report = {
        "sources": [{"source": r.source, "conversations": len(r.conversations), "skipped": r.skipped,
                     "errors": r.errors[:5]} for r in results],
        "seq_len": seq_len,
        "preserve_thinking": preserve_thinking,
        "calibration": render_sessions_with_stats(calibration, tokenizer, seq_len,
                                                  preserve_thinking=preserve_thinking).stats.to_dict(),
        "heldout": render_sessions_with_stats(heldout, tokenizer, seq_len, preserve_thinking=preserve_thinking,
                                              exclude=calibration).stats.to_dict(),
    }
    text = json.dumps(report, indent=2)
    if json_out is not None:
        json_out.write_text(text + "\n")
    click.echo(text)
