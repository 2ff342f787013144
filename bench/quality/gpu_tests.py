"""Run the GPU-marked tests and record the run as a result file: counts, failures, the GPU, and which tree ran.

The device machine receives a copy of the working tree whose git metadata may name an older commit, so besides
`git_commit` the file records `tree`: the git tree hash of the files that ran (`git write-tree` over a scratch
index), which equals `git rev-parse COMMIT^{tree}` of the commit they were sent from.

    python -m bench.quality.gpu_tests --json bench/results/gpu_tests_h200.json [-- extra pytest args]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from bench.harness.provenance import REPO_ROOT, provenance


def tree_hash() -> str | None:
    """The git tree of the checkout's files as they are (tracked and untracked, ignored and carried wheels not)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        try:
            subprocess.run(["git", "-C", str(REPO_ROOT), "add", "-A", "--", ".", ":!.whl"], env=env, check=True,
                           capture_output=True, timeout=120)
            out = subprocess.run(["git", "-C", str(REPO_ROOT), "write-tree"], env=env, check=True,
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
    return out.stdout.strip() or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("pytest_args", nargs="*", default=["tests"])
    args = ap.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", f"--junitxml={junit}",
               *args.pytest_args]
        rc = subprocess.run(cmd, cwd=REPO_ROOT).returncode
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
                  if case.find("failure") is not None or case.find("error") is not None]
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    record = {**provenance(), "tree": tree_hash(), "pytest_exit_code": rc,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"], **counts,
              "failed_tests": failed}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "failed_tests"}, indent=2), "\nfailed:", failed)


if __name__ == "__main__":
    main()
