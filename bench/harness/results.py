"""The argument base every bench script shares (`--json`) and how a result file is written (provenance first)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.harness.provenance import provenance


def bench_parser(doc: str | None, *, json_default: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with the script's docstring as help and the `--json RESULT_FILE` every script takes."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=Path(json_default) if json_default else None,
                        help="write the result file here (bench/results/NAME.json)")
    return parser


def write_result(path: Path | str | None, record: dict, *, device=None) -> dict:
    """The record with the harness's provenance (command, commit, host, device, ...) written to `path` as JSON
    (nothing written when `path` is None); the record's own fields win over provenance's."""
    full = {**provenance(device=device), **record}
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(full, indent=2) + "\n")
    return full
