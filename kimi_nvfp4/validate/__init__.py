"""validate: INT4 source vs NVFP4 checkpoint, layer by layer, with gates CI can rely on (issue #6)."""

from .api import DEFAULT_MODES, validate_checkpoint
from .gates import DEFAULT_GATES, GateResult, GateThresholds, ModeThresholds, load_gates
from .report import ValidationReport
from .structure import StructureReport, check_structure

__all__ = [
    "DEFAULT_GATES",
    "DEFAULT_MODES",
    "GateResult",
    "GateThresholds",
    "ModeThresholds",
    "StructureReport",
    "ValidationReport",
    "check_structure",
    "load_gates",
    "validate_checkpoint",
]
