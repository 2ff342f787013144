"""checkpoint/artifacts.py spells out every stage's own file names; these must stay the stages' constants."""

from __future__ import annotations

from pathlib import PurePath

from kimi_nvfp4.calibrate import api as calibrate_api
from kimi_nvfp4.calibrate import report as calibrate_report
from kimi_nvfp4.calibrate.shard import INPUT_SCALES_SHARD
from kimi_nvfp4.checkpoint.artifacts import OWN_FILE_NAMES, OWN_TOP_LEVEL_DIRS, is_own_artifact
from kimi_nvfp4.checkpoint.manifest import MANIFEST_NAME
from kimi_nvfp4.pipeline.summary import SUMMARY_NAME
from kimi_nvfp4.publish.files import REPORT_DIR_NAME
from kimi_nvfp4.serve_check.report import REPORT_STEM
from kimi_nvfp4.validate import report as validate_report


def test_names_are_the_stages_constants():
    stage_names = {
        MANIFEST_NAME, INPUT_SCALES_SHARD, calibrate_report.REPORT_JSON, calibrate_report.REPORT_MD,
        validate_report.REPORT_JSON, validate_report.REPORT_MD, f"{REPORT_STEM}.json", f"{REPORT_STEM}.md",
        f"{SUMMARY_NAME}.json", f"{SUMMARY_NAME}.md", "model_card_preview.md",
    }
    assert stage_names == OWN_FILE_NAMES
    assert {REPORT_DIR_NAME, calibrate_api.CALIBRATION_DIR} == OWN_TOP_LEVEL_DIRS


def test_matching():
    assert is_own_artifact(PurePath("reports/anything.txt"))
    assert is_own_artifact(PurePath("sub/validate_report.json"))
    assert is_own_artifact(PurePath(MANIFEST_NAME))
    assert not is_own_artifact(PurePath("reports"))  # a plain file named like the folder is the source's own
    assert not is_own_artifact(PurePath("tokenizer_config.json"))
    assert not is_own_artifact(PurePath("docs/reports/x.md"))
