"""kill -9 at chosen points of a real `kimi-nvfp4 convert` process, then a re-run: it resumes (or starts afresh)
and writes the pinned bytes. The kill lands just before a chosen rename, so the partial file is left behind.

The case that once stranded the folder: a kill during the very first manifest write left only
`.kimi_nvfp4_manifest.json.partial`, which every re-run (even with --overwrite) took for foreign content (exit 4).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kimi_nvfp4.checkpoint.manifest import MANIFEST_NAME, load_manifest
from kimi_nvfp4.checkpoint.writer import is_partial_name
from kimi_nvfp4.convert import convert_checkpoint

from .test_pinned_output import PINNED_SHARDS

REPO = Path(__file__).resolve().parents[2]
# Kill this process with SIGKILL just before the N-th rename onto a file whose name matches (os.replace is how
# every atomic write of ours finishes).
_DRIVER = textwrap.dedent("""
    import os, signal, sys
    target, nth, src, out, *extra = sys.argv[1:]
    real_replace, seen = os.replace, []

    def replace(a, b, *args, **kwargs):
        name = os.path.basename(os.fspath(b))
        if name == target or (target == "*.safetensors" and name.endswith(".safetensors")):
            seen.append(name)
            if len(seen) == int(nth):
                os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(a, b, *args, **kwargs)

    os.replace = replace
    from kimi_nvfp4.cli import main
    main(["convert", src, out, "--method", "amax", "--no-stats", "--device", "cpu", "--no-progress", *extra])
""")


def _killed_convert(source: Path, out: Path, target: str, nth: int = 1, *extra: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _DRIVER, target, str(nth), str(source), str(out), *extra],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


def _assert_pinned(out: Path) -> None:
    manifest = load_manifest(out)
    assert manifest.complete
    assert {f: r.sha256 for f, r in manifest.shards.items()} == PINNED_SHARDS["amax"]
    assert not [p.name for p in out.iterdir() if is_partial_name(p.name)]


@pytest.mark.parametrize("overwrite", [False, True], ids=["rerun", "rerun-overwrite"])
def test_kill_during_the_first_manifest_write(source, tmp_path, overwrite):
    out = tmp_path / "out"
    _killed_convert(source, out, MANIFEST_NAME)
    assert f".{MANIFEST_NAME}.partial" in {p.name for p in out.iterdir()}
    assert not (out / MANIFEST_NAME).exists()
    summary = convert_checkpoint(source, out, method="amax", device="cpu", progress=False, record_stats=False,
                                 overwrite=overwrite)
    assert summary.shards_converted == 5
    _assert_pinned(out)


@pytest.mark.parametrize(
    "target, nth, converted_after",
    [("*.safetensors", 2, 4), (".kimi_nvfp4_stamps.json", 2, 4), ("config.json", 1, 0)],
    ids=["second-shard-rename", "between-shard-and-its-record", "finishing"],
)
def test_kill_mid_conversion_resumes_to_the_pinned_bytes(source, tmp_path, target, nth, converted_after):
    out = tmp_path / "out"
    _killed_convert(source, out, target, nth)
    summary = convert_checkpoint(source, out, method="amax", device="cpu", progress=False, record_stats=False)
    assert summary.shards_converted == converted_after
    _assert_pinned(out)
