"""Held-out windows are disjoint from calibration windows and from each other (issue 17).

The demo's builtin data used to give, in each 64-window held-out draw, a window equal to a
calibration window and windows equal to each other: every session repeats the same tool
declarations and system prompt (559 tokens with the demo tokenizer), and each session was cut
into windows on its own, so their first windows were the same text. This runs the real path, the
calibrate/validate loader over generated sessions, with the calibration and held-out stages making
different numbers of sessions as they do in the demo.
"""

from __future__ import annotations

import pytest

from kimi_nvfp4.stage_kit.samples import load_sample_set
from kimi_nvfp4.data.agent_sessions import generate_agent_sessions
from kimi_nvfp4.data.render import served_requests
from kimi_nvfp4.data.tokenizer import load_tokenizer
from kimi_nvfp4.demo_model import DEMO_CHECKPOINT

SEQ_LEN = 256
EVERY_WINDOW = None  # every window of the part, short ones included


def _windows(part: str, sessions: int, seed: int) -> list[tuple[int, ...]]:
    result = load_sample_set(DEMO_CHECKPOINT, "builtin", part=part, samples=EVERY_WINDOW, seq_len=SEQ_LEN, seed=seed,
                             generated_sessions=sessions)
    return [tuple(s.tolist()) for s in result.sequences]


def test_the_shared_preamble_is_longer_than_a_window():
    """The situation of the issue: without care, every session's first window is the same text."""
    tok = load_tokenizer(DEMO_CHECKPOINT)
    a, b = (served_requests(c, tok)[0].tokens for c in generate_agent_sessions(None, n=2, seed=0, max_turns=1))
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared > SEQ_LEN


@pytest.mark.parametrize("seed", [0, 1])
def test_heldout_windows_are_disjoint_from_calibration_and_distinct(seed):
    calibration = _windows("calibration", 6, seed)
    heldout = _windows("heldout", 16, seed)
    assert calibration and heldout
    assert len(calibration) == len(set(calibration))
    assert len(heldout) == len(set(heldout))
    assert not set(heldout) & set(calibration)


def test_heldout_of_only_duplicate_windows_says_why(tmp_path):
    """Held-out sessions whose every window is a calibration window (here: the same session on both sides) render
    to nothing; the error says that is why, rather than only that nothing was rendered."""
    import json

    from kimi_nvfp4.data.loaders import load_jsonl
    from kimi_nvfp4.data.render import SessionRequests, served_requests, window_groups
    from kimi_nvfp4.stage_kit.samples import DataPart, why_no_sequence

    record = {"messages": [{"role": "user", "content": "list the files in src please"},
                           {"role": "assistant", "content": "Here they are: main.py, util.py and test.py."}]}
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(record) + "\n")
    conv = load_jsonl(path).conversations[0]
    tok = load_tokenizer(DEMO_CHECKPOINT)
    group = SessionRequests(conv.id, served_requests(conv, tok))
    heldout = window_groups([group], 16, exclude=[group])
    assert not heldout.sequences and heldout.stats.rendered_tokens >= 2
    assert "duplicate calibration windows" in why_no_sequence(heldout.stats.rendered_tokens, DataPart.HELDOUT)
    assert "too short" in why_no_sequence(0, DataPart.HELDOUT)
