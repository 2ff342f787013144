"""The pipeline's one summary: a plain-text table for the terminal, Markdown and JSON beside the reports."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ..errors import OutputError

SUMMARY_NAME = "pipeline_summary"


class StageStatus(str, Enum):
    RAN = "ran"
    SKIPPED = "skipped"  # already complete with the same settings (resume)
    FAILED = "FAILED"
    NOT_RUN = "not run"  # an earlier stage failed
    DISABLED = "disabled"  # turned off in the config


@dataclass
class StageResult:
    name: str
    status: StageStatus
    seconds: float = 0.0
    summary: str = ""
    exit_code: int = 0
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class PipelineSummary:
    source: str
    output: str
    stages: list[StageResult]
    report_dir: str | None = None

    @property
    def exit_code(self) -> int:
        """The exit code of the first failing stage; 0 when none failed."""
        return next((s.exit_code for s in self.stages if s.status is StageStatus.FAILED), 0)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def result(self, name: str) -> StageResult:
        return next(s for s in self.stages if s.name == name)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for stage in data["stages"]:
            stage["status"] = stage["status"].value
        data["exit_code"] = self.exit_code
        return data

    def _rows(self) -> list[tuple[str, str, str, str]]:
        untimed = (StageStatus.DISABLED, StageStatus.NOT_RUN)
        return [(s.name, s.status.value, "" if s.status in untimed else f"{s.seconds:.1f}s", s.summary)
                for s in self.stages]

    def to_table(self) -> str:
        header = ("stage", "status", "time", "result")
        rows = [header] + self._rows()
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = []
        for i, row in enumerate(rows):
            lines.append("  ".join(cell.ljust(widths[j]) for j, cell in enumerate(row[:3])) + "  " + row[3])
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(header[3]))
        verdict = "pipeline OK" if self.ok else f"pipeline FAILED (exit {self.exit_code})"
        return "\n".join(lines + ["", f"{verdict}: {self.output}"])

    def to_markdown(self) -> str:
        lines = [f"# Pipeline summary\n\nsource `{self.source}` -> output `{self.output}`\n",
                 "| stage | status | time | result |", "|---|---|---:|---|"]
        lines += [f"| {a} | {b} | {c} | {d.replace('|', '/')} |" for a, b, c, d in self._rows()]
        lines.append(f"\nexit code: {self.exit_code}\n")
        return "\n".join(lines)

    def write(self, report_dir: Path) -> tuple[Path, Path]:
        """pipeline_summary.json and .md, each written under a temporary name and renamed."""
        from ..checkpoint.writer import write_bytes_atomic  # a full or read-only disk: OutputError (exit 4)

        try:
            report_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"file {report_dir}: cannot create the report folder ({e.strerror or e})") from None
        paths = []
        for suffix, text in (("json", json.dumps(self.to_dict(), indent=2, default=str) + "\n"),
                             ("md", self.to_markdown())):
            path = report_dir / f"{SUMMARY_NAME}.{suffix}"
            write_bytes_atomic(path, text.encode(), durable=False)
            paths.append(path)
        return paths[0], paths[1]
