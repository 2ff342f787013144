"""The scale methods, one module each; every module defines `PLUGIN = ScaleMethodSpec(...)` (see registry.py)."""
