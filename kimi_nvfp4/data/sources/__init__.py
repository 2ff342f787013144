"""The catalog of `--data` sources: one module per kind, each defining `PLUGIN = DataSource(...)`
(data/source_registry.py discovers them). Adding a source is adding a module here, plus its tests."""
