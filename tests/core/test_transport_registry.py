"""Transport discovery by name: only the requested driver is imported; every failure is one clear error."""

from __future__ import annotations

import sys

import pytest

from reshard_core.errors import PluginError
from reshard_core.transport.registry import get_transport, transport_names


def test_names_are_sorted_and_listing_imports_nothing(plugin_fixtures):
    plugin_fixtures("good_plugins")
    assert transport_names() == ["alpha", "beta", "heavy", "missing", "notservice"]
    assert not any(name.startswith("fixture_") for name in sys.modules)


def test_get_transport_loads_only_that_driver(plugin_fixtures):
    plugin_fixtures("good_plugins")
    beta = get_transport("beta")
    assert (beta.__module__, beta.__name__) == ("fixture_transports", "BetaCopyService")
    assert beta.unavailable_reason() == "beta needs a beta card"
    assert "fixture_heavy_transport" not in sys.modules
    assert "fixture_alpha_transport" not in sys.modules
    assert "fixture_hooked_plugin" not in sys.modules
    heavy = get_transport("heavy")
    assert heavy.__name__ == "HeavyCopyService"
    assert "fixture_heavy_transport" in sys.modules


def test_unknown_transport_lists_known_names(plugin_fixtures):
    plugin_fixtures("good_plugins")
    with pytest.raises(PluginError, match=r"^unknown transport 'x'; "
                                          r"known transports: alpha, beta, heavy, missing, notservice$"):
        get_transport("x")


def test_unknown_transport_with_none_installed(plugin_fixtures):
    plugin_fixtures()
    expected = r"^unknown transport 'gloo'; known transports: \(none installed\)$"
    with pytest.raises(PluginError, match=expected):
        get_transport("gloo")


def test_unknown_transport_in_this_installation(fresh_plugin_manager):
    # The README install provides exactly these four transports.
    known = "gloo, ipc, nccl, nvshmem"
    with pytest.raises(PluginError, match=rf"^unknown transport 'x'; known transports: {known}$"):
        get_transport("x")


def test_transport_claimed_by_two_distributions(plugin_fixtures):
    plugin_fixtures("conflicts")
    with pytest.raises(PluginError, match=r"^transport name 'dupe' is claimed by more than one distribution: "
                                          r"fixture-conflict-c 0\.3, fixture-conflict-d 0\.4; "
                                          r"uninstall all but one$"):
        get_transport("dupe")


def test_import_failure_names_transport_and_error(plugin_fixtures):
    plugin_fixtures("good_plugins")
    expected = (r"^transport 'missing' \(fixture-transports 0\.3\) failed to load: "
                r"ModuleNotFoundError: No module named 'fixture_transport_missing'$")
    with pytest.raises(PluginError, match=expected):
        get_transport("missing")


def test_entry_point_that_is_not_a_copy_service(plugin_fixtures):
    plugin_fixtures("good_plugins")
    with pytest.raises(PluginError, match=r"^transport 'notservice' \(fixture-transports 0\.3\) points to "
                                          r"fixture_transports:NotACopyService, "
                                          r"which is not a CopyService subclass$"):
        get_transport("notservice")


def test_disabled_by_its_own_name_or_its_plugin_name(plugin_fixtures, monkeypatch):
    plugin_fixtures("good_plugins")
    monkeypatch.setenv("RESHARD_DISABLE_PLUGINS", "beta,hooked")
    expected = r"^transport 'beta' is disabled by RESHARD_DISABLE_PLUGINS \(beta\)$"
    with pytest.raises(PluginError, match=expected):
        get_transport("beta")
    with pytest.raises(PluginError, match=r"^transport 'alpha' is disabled by RESHARD_DISABLE_PLUGINS "
                                          r"\(hooked\)$"):
        get_transport("alpha")
    assert get_transport("heavy").__name__ == "HeavyCopyService"


def test_sees_distributions_installed_after_a_first_lookup(plugin_fixtures):
    # stevedore caches each group's entry points for the whole process; the registry must not.
    plugin_fixtures("conflicts")
    with pytest.raises(PluginError, match=r"^unknown transport 'beta'; known transports: dupe$"):
        get_transport("beta")
    plugin_fixtures("good_plugins")
    assert get_transport("beta").__name__ == "BetaCopyService"
