"""A crash-safe switch of the declared activation scheme across config.json and hf_quant_config.json.

The scheme lives in two files (modelopt_config.py) and no file system renames two files at once. SGLang
0.5.23 reads config.json's `quantization_config` first (configs/model_config.py `_parse_quant_hf_config`)
and hf_quant_config.json only when config.json has none, so a kill between the two writes used to leave a
checkpoint that one engine serves as W4A4 and our own tools read as W4A16. The switch is therefore
journalled: the complete new contents of both files are written (atomically, durably) to
`JOURNAL_NAME` first, then both files, then the journal is removed. Every reader (`CheckpointReader`,
check-engine, `set_activation_scheme` itself) calls `recover_scheme_switch` first: a journal left by a kill
is rolled forward, so no reader of ours ever sees the two files disagree. A reader that cannot write the
folder refuses it with a CheckpointError naming the journal instead of reading a half-switched checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import CheckpointError, OutputError

JOURNAL_NAME = ".kimi-nvfp4-scheme-switch.json"
CONFIG_NAME = "config.json"
HF_QUANT_CONFIG_NAME = "hf_quant_config.json"


class SchemeSwitch(BaseModel):
    """The journal: both files' complete new contents (written in this order: hf_quant_config.json, config.json)."""

    model_config = ConfigDict(extra="forbid")

    quant_algo: str
    hf_quant_config: dict[str, Any]
    config: dict[str, Any]


def journal_path(root: str | Path) -> Path:
    return Path(root) / JOURNAL_NAME


def write_scheme_switch(root: str | Path, switch: SchemeSwitch, *, durable: bool = True) -> None:
    """Journal, hf_quant_config.json, config.json, remove the journal: a kill at any point leaves either the
    old pair, or a journal that `recover_scheme_switch` completes, or the new pair."""
    from .writer import write_json_atomic  # writer imports the reader, which calls recover_scheme_switch

    root = Path(root)
    write_json_atomic(journal_path(root), switch.model_dump(mode="json"), durable=durable)
    _apply(root, switch, durable=durable)


def _apply(root: Path, switch: SchemeSwitch, *, durable: bool) -> None:
    from .writer import write_json_atomic

    write_json_atomic(root / HF_QUANT_CONFIG_NAME, switch.hf_quant_config, durable=durable)
    write_json_atomic(root / CONFIG_NAME, switch.config, durable=durable)
    journal_path(root).unlink()
    if durable:  # the unlink itself must reach the disk before anyone relies on the pair
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def recover_scheme_switch(root: str | Path, *, durable: bool = True) -> bool:
    """Finish a switch a kill interrupted (True if there was one). Every reader of a converted folder calls this
    before reading config.json or hf_quant_config.json.

    :raises CheckpointError: the journal is unreadable, or the folder cannot be written to finish the switch
    """
    root = Path(root)
    path = journal_path(root)
    if not path.is_file():
        return False
    try:
        switch = SchemeSwitch.model_validate_json(path.read_bytes())
    except (OSError, ValidationError, json.JSONDecodeError) as e:
        raise CheckpointError(f"an interrupted activation-scheme switch left a journal that cannot be read ({e}); "
                              "config.json and hf_quant_config.json may disagree: rerun `kimi-nvfp4 calibrate`",
                              file=path) from None
    try:
        _apply(root, switch, durable=durable)
    except (OSError, OutputError) as e:
        raise CheckpointError(
            f"an activation-scheme switch to {switch.quant_algo} was interrupted and cannot be finished here ({e}); "
            "config.json and hf_quant_config.json may disagree until a process that can write this folder reads it",
            file=path,
        ) from None
    return True
