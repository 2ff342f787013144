"""The catalog of engine drivers (`engine_registry.ENGINES`): one module per serving engine, each defining
`PLUGIN = EngineDriver(...)`. Adding an engine is adding a module here (and its rows in the corruption
catalogue, tests/engine_check/corruptions.py)."""
