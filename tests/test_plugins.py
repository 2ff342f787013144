"""The one registry mechanism (kimi_nvfp4/plugins.py): name and alias look-up, typed options, discovery."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from kimi_nvfp4.plugins import NoOptions, Plugin, PluginError, Registry, parse_option_pairs


class _Damped(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    damping: float = 0.01
    block_size: int = 128


def _registry() -> Registry[Plugin]:
    reg: Registry[Plugin] = Registry("widget", Plugin)
    reg.register(Plugin("alpha", "first", options_model=_Damped, aliases=("a",)))
    reg.register(Plugin("beta_two", "second"))
    return reg


def test_lookup_by_name_alias_and_spelling():
    reg = _registry()
    assert reg.get("alpha").name == "alpha"
    assert reg.get("A").name == "alpha"
    assert reg.get("beta-two").name == "beta_two"
    assert "beta_two" in reg and "gamma" not in reg
    assert reg.names() == ["alpha", "beta_two"]


def test_unknown_entry_names_the_registered_ones():
    with pytest.raises(PluginError, match="unknown widget 'gamma'; registered: alpha, beta_two"):
        _registry().get("gamma")


def test_a_name_or_alias_registered_twice_is_refused():
    reg = _registry()
    with pytest.raises(ValueError, match="registered twice"):
        reg.register(Plugin("other", "x", aliases=("alpha",)))
    assert reg.names() == ["alpha", "beta_two"]  # nothing half-registered


def test_options_are_typed_and_unknown_keys_refused():
    entry = _registry().get("alpha")
    opts = entry.parse_options(parse_option_pairs(["damping=0.02", "block-size=64"]))
    assert opts == _Damped(damping=0.02, block_size=64)
    assert entry.parse_options(None) == _Damped()
    with pytest.raises(PluginError, match="alpha: option damping: .*its options: damping, block_size"):
        entry.parse_options({"damping": "lots"})
    with pytest.raises(PluginError, match="option colour"):
        entry.parse_options({"colour": "red"})
    assert isinstance(_registry().get("beta_two").parse_options(), NoOptions)
    with pytest.raises(PluginError):
        _registry().get("beta_two").parse_options({"x": 1})


def test_option_pairs_need_key_and_value():
    with pytest.raises(PluginError, match="expected KEY=VALUE"):
        parse_option_pairs(["damping"])
    assert parse_option_pairs(["a=1=2"]) == {"a": "1=2"}


def test_an_order_key_sorts_names_entries_and_help():
    reg: Registry[Plugin] = Registry("widget", Plugin, order=lambda e: (e.name != "zeta", e.name))
    for name in ("beta", "zeta", "alpha"):
        reg.register(Plugin(name, name.upper()))
    assert reg.names() == ["zeta", "alpha", "beta"]
    assert [e.name for e in reg.entries()] == ["zeta", "alpha", "beta"]
    assert reg.help_text() == "zeta: ZETA; alpha: ALPHA; beta: BETA"
