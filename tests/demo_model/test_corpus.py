"""Corpus split: by path hash only, disjoint, excluded folders skipped."""

from __future__ import annotations

import pytest

from kimi_nvfp4.demo_model.corpus import is_heldout, load_corpus


def _tree(root, names):
    for name in names:
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"# {name}\nx = 1\n", encoding="utf-8")
    return root


def test_split_depends_on_the_path_only_and_is_disjoint(tmp_path):
    names = [f"pkg{i % 7}/mod{i}.py" for i in range(200)]
    split = load_corpus(_tree(tmp_path, names), heldout_fraction=0.2)
    train = {f.relpath for f in split.train}
    held = {f.relpath for f in split.heldout}
    assert not train & held and train | held == set(names)
    assert held == {n for n in names if is_heldout(n, 0.2)}
    assert 20 <= len(held) <= 60  # ~40 expected of 200


def test_excluded_folders_and_empty_files_are_skipped(tmp_path):
    names = [f"m{i}.py" for i in range(60)] + ["site-packages/x.py", "encodings/cp1.py", "a/__pycache__/z.py",
                                                "lib2to3/tests/data/py2.py"]
    root = _tree(tmp_path, names)
    (root / "empty.py").write_text("\n")
    split = load_corpus(root, heldout_fraction=0.2)
    kept = {f.relpath for f in split.train + split.heldout}
    assert kept == {f"m{i}.py" for i in range(60)}


def test_a_corpus_without_held_out_files_is_refused(tmp_path):
    with pytest.raises(ValueError, match="both splits"):
        load_corpus(_tree(tmp_path, ["only.py"]), heldout_fraction=0.0)
