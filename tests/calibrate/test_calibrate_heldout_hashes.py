"""Held-out windows are disjoint from the windows calibrate used, across runs (issue #27, data/window_pick.py).

Same-load disjointness (split by conversation, one prefix tree) cannot see a calibrate run that loaded other data:
another --seed of a generator, or the same traffic grouped differently. Calibrate records hashes of the windows it
used; the held-out part drops them. Here the validation data is the calibration traffic with session ids added,
which regroups it: requests that calibrate used land in the held-out part.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from kimi_nvfp4.calibrate import calibrate_checkpoint
from kimi_nvfp4.checkpoint.manifest import load_manifest
from kimi_nvfp4.data.tokenizer import load_tokenizer
from kimi_nvfp4.data.window_pick import CALIBRATION_WINDOWS_RECORD, window_hash
from kimi_nvfp4.stage_kit.samples import DataPart, load_sample_set

sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
from traffic_fixtures import entry, write_dump  # noqa: E402

SEQ_LEN = 32
REQUESTS = 30


def _traffic(folder: Path, tokenizer, *, sessions: bool) -> str:
    sp = tokenizer.special_ids
    entries = []
    for i in range(REQUESTS):
        text = f"request {i}: read the parser module and fix the failing test number {i} before the release"
        ids = [sp["<|im_user|>"], *tokenizer.encode(text), sp["<|im_end|>"]]
        entries.append(entry(ids, [5, 6], t=i, session=f"agent-{i}" if sessions else None))
    write_dump(folder / "2026-01-01_00-00-00.pkl", entries)
    return f"sglang-dump:{folder}"


def test_heldout_leaves_out_every_window_calibrate_used(converted_pair, tmp_path):
    src, out = converted_pair
    tokenizer = load_tokenizer(out)
    calib_spec = _traffic(tmp_path / "a", tokenizer, sessions=False)
    valid_spec = _traffic(tmp_path / "b", tokenizer, sessions=True)
    before = load_sample_set(out, valid_spec, part=DataPart.HELDOUT, samples=None, seq_len=SEQ_LEN, seed=0)
    assert before.excluded_windows == 0  # nothing recorded yet
    available = load_sample_set(out, calib_spec, part=DataPart.CALIBRATION, samples=None, seq_len=SEQ_LEN, seed=1)
    samples = sum(1 for s in available.sequences if s.numel() == SEQ_LEN)
    report = calibrate_checkpoint(out, src, calib_spec, samples=samples, seq_len=SEQ_LEN, seed=1, device="cpu",
                                  progress=False)
    recorded = load_manifest(out).stages["calibrate"].outputs[CALIBRATION_WINDOWS_RECORD]
    assert len(recorded) == report.sequences == samples
    assert all(re.fullmatch(r"[0-9a-f]{16}", h) for h in recorded)  # hashes, never ids

    heldout = load_sample_set(out, valid_spec, part=DataPart.HELDOUT, samples=None, seq_len=SEQ_LEN, seed=0)
    assert heldout.excluded_windows > 0  # the regrouping moved calibrated requests to the held-out side
    assert not {window_hash(s) for s in heldout.sequences} & set(recorded)
    kept = [s.tolist() for s in before.sequences if window_hash(s) not in set(recorded)]
    assert [s.tolist() for s in heldout.sequences] == kept
    assert len(before.sequences) - len(kept) == heldout.excluded_windows
