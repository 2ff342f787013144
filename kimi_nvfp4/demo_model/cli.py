"""`kimi-nvfp4 build-demo-model`: a thin click layer over `build_demo_model`."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("build-demo-model")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Train on the CPU (slow; use fewer --steps) or on a CUDA GPU.")
@click.option("--steps", type=int, default=3500, show_default=True, help="Optimizer steps.")
@click.option("--batch-size", type=int, default=32, show_default=True, help="Sequences per step.")
@click.option("--seq-len", type=int, default=512, show_default=True, help="Tokens per sequence.")
@click.option("--lr", type=float, default=3e-3, show_default=True, help="Peak learning rate (AdamW).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for init, data order and batches.")
@click.option("--chat-sessions", type=int, default=3000, show_default=True,
              help="Rendered agent-style chats mixed into the stdlib code.")
@click.option("--source-root", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Folder of Python source to train on [default: this interpreter's standard library].")
@click.option("--tokenizer-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Reuse tokenizer.json/tokenizer_config.json from here instead of training a new one.")
@click.option("--heldout-fraction", type=float, default=0.05, show_default=True,
              help="Share of source files (chosen by path hash) never trained on; perplexity is measured there.")
@click.option("--time-budget-s", type=float, default=None,
              help="Instead of --steps: time a few steps, then train for about this many seconds.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it already holds files.")
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
def build_demo_model_command(out: Path, device: str, steps: int, batch_size: int, seq_len: int, lr: float,
                             seed: int, chat_sessions: int, source_root: Path | None,
                             tokenizer_dir: Path | None, heldout_fraction: float, time_budget_s: float | None,
                             overwrite: bool, no_progress: bool) -> None:
    """Train the tiny K2 on stdlib source and write it to OUT as a K2.6-layout INT4 checkpoint.

    Reproducible: the same seed, source tree and device give the same checkpoint. Writes
    OUT/training_report.json with the held-out perplexity of the trained model and of the
    exported INT4 checkpoint.
    """
    import torch

    from ..errors import DeviceError
    from .build import build_demo_model
    from .train import TrainSettings

    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--device cuda asked for, but torch sees no CUDA device")
    settings = TrainSettings(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed,
                             chat_sessions=chat_sessions, eval_every=max(1, min(500, steps // 4)),
                             warmup_steps=min(100, max(1, steps // 10)))
    report = build_demo_model(out, device=device, settings=settings, source_root=source_root,
                              tokenizer_dir=tokenizer_dir, heldout_fraction=heldout_fraction,
                              time_budget_s=time_budget_s, overwrite=overwrite, progress=not no_progress,
                              log=click.echo)
    click.echo(f"wrote {out} ({report.checkpoint_bytes / 2**20:.2f} MiB of tensors, "
               f"{report.parameters} parameters, trained {report.seconds['train']:.0f} s)")
