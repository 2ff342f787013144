"""The output folder's lock: exclusive across processes, re-entrant within one, released however the holder ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kimi_nvfp4.checkpoint.output_lock import LOCK_NAME, holds_lock, holds_output_lock, output_lock
from kimi_nvfp4.errors import OutputError

REPO = Path(__file__).resolve().parents[2]
_HOLDER = textwrap.dedent("""
    import sys
    from kimi_nvfp4.checkpoint.output_lock import output_lock
    with output_lock(sys.argv[1], sys.argv[2]):
        print("locked", flush=True)
        sys.stdin.read()  # until the test closes stdin (or kills us)
""")


class Holder:
    """Another process holding the lock on `folder` as `command` (a context manager; killed on exit)."""

    def __init__(self, folder: Path, command: str = "convert"):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder), command], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout.readline().strip() == "locked"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def __enter__(self) -> Holder:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


@pytest.fixture
def holder():
    made: list[Holder] = []

    def start(folder: Path, command: str = "convert") -> Holder:
        made.append(Holder(folder, command))
        return made[-1]

    yield start
    for h in made:
        h.kill()


def test_a_second_process_is_refused_with_the_holder_named(tmp_path, holder):
    folder = tmp_path / "out"
    h = holder(folder, "convert")
    with pytest.raises(OutputError, match=f"in use by pid {h.pid} \\(kimi-nvfp4 convert, started 20") as e:
        with output_lock(folder, "calibrate"):
            pass
    assert e.value.exit_code == 4 and "kimi-nvfp4 calibrate" in str(e.value)


def test_released_when_the_holder_is_killed(tmp_path, holder):
    folder = tmp_path / "out"
    holder(folder).kill()  # SIGKILL: no cleanup ran, the OS dropped the lock
    assert (folder / LOCK_NAME).is_file()  # the file stays; the lock does not
    with output_lock(folder, "convert"):
        assert holds_lock(folder)
    assert not holds_lock(folder)


def test_reentrant_within_a_process_and_released_after_the_outermost(tmp_path, holder):
    folder = tmp_path / "out"
    with output_lock(folder, "run"):
        with output_lock(folder, "convert"):
            pass
        assert holds_lock(folder)
    assert not holds_lock(folder)
    h = holder(folder)  # free for another process now
    assert h.proc.poll() is None


def test_released_when_the_block_raises(tmp_path):
    folder = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with output_lock(folder, "convert"):
            raise RuntimeError("boom")
    assert not holds_lock(folder)


def test_without_create_a_missing_folder_is_neither_made_nor_locked(tmp_path):
    with output_lock(tmp_path / "absent", "publish", create=False):
        assert not (tmp_path / "absent").exists()


def test_decorator_locks_the_named_argument_when_asked(tmp_path):
    seen = []

    @holds_output_lock("validate", "output", when=lambda a: a["record"])
    def stage(output, *, record=True):
        seen.append(holds_lock(output))

    (tmp_path / "o").mkdir()
    stage(tmp_path / "o")
    stage(tmp_path / "o", record=False)
    assert seen == [True, False]


def test_a_failed_run_leaves_no_lock_file_or_folder_it_created(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(OutputError):
        with output_lock(foreign, "convert"):
            raise OutputError("holds other content")
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    with pytest.raises(OutputError):
        with output_lock(tmp_path / "new" / "out", "convert"):
            raise OutputError("bad source")
    assert not (tmp_path / "new" / "out").exists()
    with output_lock(foreign, "convert"):
        pass
    assert (foreign / LOCK_NAME).is_file()  # a run that worked keeps it (see the module docstring)
