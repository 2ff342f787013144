"""validate: INT4 source vs NVFP4 checkpoint, layer by layer, with gates CI can rely on (issue #6)."""

from .api import validate_checkpoint
from .gates import DEFAULT_GATES, GateResult, GateThresholds, ModeThresholds, load_gates
from .options import DEFAULT_MODES, ValidateOptions
from .report import ValidationReport
from .structure import StructureReport, check_structure

__all__ = [
    "DEFAULT_GATES",
    "DEFAULT_MODES",
    "GateResult",
    "GateThresholds",
    "ModeThresholds",
    "StructureReport",
    "ValidateOptions",
    "ValidationReport",
    "check_structure",
    "load_gates",
    "validate_checkpoint",
]
