"""kimi-nvfp4: Kimi K2.6 INT4 -> NVFP4 conversion, calibration, validation and serving checks."""

__version__ = "0.1.0"
