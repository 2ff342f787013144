"""The `--data` option of every command, its help listing the registered sources (data/source_registry.py).

The list is generated when help is shown, not when the CLI is imported: registry discovery imports every source
module, which `kimi-nvfp4 --help` and the other commands need not pay for.
"""

from __future__ import annotations

from typing import Any

import click


class DataSpecOption(click.Option):
    """`--data SPEC`: `purpose` followed by the registered kinds."""

    def __init__(self, *args: Any, purpose: str, **kwargs: Any):
        self.purpose = purpose
        super().__init__(*args, **kwargs)

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        from .source_registry import spec_help

        self.help = f"{self.purpose} Kinds: {spec_help()}."
        return super().get_help_record(ctx)


def data_option(purpose: str, **kwargs: Any):
    """The `--data` click option (required unless `kwargs` say otherwise)."""
    kwargs.setdefault("required", True)
    return click.option("--data", "data", cls=DataSpecOption, purpose=purpose, **kwargs)
