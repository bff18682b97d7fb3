"""The plugin manager: loading, status records, API checks, conflicts, env knobs, in-process plugins."""

from __future__ import annotations

import sys

import pytest

from reshard_core import PLUGIN_API_VERSION
from reshard_core.errors import PluginError
from reshard_core.hookspecs import hookimpl
from reshard_core.plugin_status import PluginRecord
from reshard_core.plugins import (
    get_plugin_manager,
    plugin_records,
    register_plugin,
    unregister_plugin,
)


def records_as_dicts(**kwargs) -> list[dict]:
    return [r.to_dict() for r in plugin_records(**kwargs)]


class Planner:
    """An in-process hook plugin that answers the per-tensor planning hook."""

    def __init__(self, answer):
        self.answer = answer
        self.calls = []

    @hookimpl
    def reshard_plan_tensor(self, entry, rank):
        self.calls.append((entry, rank))
        return self.answer


def test_api_version_is_one():
    assert PLUGIN_API_VERSION == 1


def test_good_plugins_are_listed_with_status_and_not_probed_at_load(plugin_fixtures):
    plugin_fixtures("good_plugins")
    get_plugin_manager()
    # Loading hooks must not import any transport module (no CUDA code on a Gloo run).
    assert "fixture_alpha_transport" not in sys.modules
    assert "fixture_transports" not in sys.modules
    assert records_as_dicts() == [
        {"name": "beta", "distribution": "fixture-transports", "version": "0.3", "transports": ["beta"],
         "hooks": [], "status": "unavailable", "reason": "beta needs a beta card"},
        {"name": "heavy", "distribution": "fixture-transports", "version": "0.3", "transports": ["heavy"],
         "hooks": [], "status": "available", "reason": None},
        {"name": "hooked", "distribution": "fixture-hooked", "version": "0.2", "transports": ["alpha"],
         "hooks": ["reshard_plan_tensor", "reshard_register_commands"], "status": "unavailable",
         "reason": "needs a flux capacitor"},
        {"name": "missing", "distribution": "fixture-transports", "version": "0.3", "transports": ["missing"],
         "hooks": [], "status": "error",
         "reason": "transport 'missing' (fixture-transports 0.3) failed to load: "
                   "ModuleNotFoundError: No module named 'fixture_transport_missing'"},
        {"name": "notservice", "distribution": "fixture-transports", "version": "0.3",
         "transports": ["notservice"], "hooks": [], "status": "error",
         "reason": "transport 'notservice' (fixture-transports 0.3) points to "
                   "fixture_transports:NotACopyService, which is not a CopyService subclass"},
    ]
    # The check loaded the hooked plugin's transport too (a broken one would be an error).
    assert "fixture_alpha_transport" in sys.modules


def test_listing_without_check_imports_no_transport_and_says_unchecked(plugin_fixtures):
    plugin_fixtures("good_plugins")
    records = records_as_dicts(check=False)
    assert [(r["name"], r["status"], r["reason"]) for r in records] == [
        (name, "unchecked", "not probed; --check loads its transports and asks")
        for name in ("beta", "heavy", "hooked", "missing", "notservice")
    ]
    assert "fixture_alpha_transport" not in sys.modules and "fixture_transports" not in sys.modules
    # A later check answers, and the answers stay.
    checked = ["unavailable", "available", "unavailable", "error", "error"]
    assert [r["status"] for r in records_as_dicts()] == checked
    assert [r["status"] for r in records_as_dicts(check=False)] == checked


def test_a_plugin_whose_transport_entry_point_is_broken_is_an_error(plugin_fixtures):
    plugin_fixtures("broken_transport")
    assert records_as_dicts(check=False)[0]["status"] == "unchecked"
    assert records_as_dicts() == [
        {"name": "sad", "distribution": "fixture-sad", "version": "0.5", "transports": ["sad", "sadder"],
         "hooks": [], "status": "error",
         "reason": "transport 'sad' (fixture-sad 0.5) failed to load: AttributeError: module "
                   "'fixture_sad_plugin' has no attribute 'GoneCopyService'"},
        {"name": "wrongtype", "distribution": "fixture-wrongtype", "version": "0.6",
         "transports": ["wrongtype"], "hooks": [], "status": "error",
         "reason": "transport 'wrongtype' (fixture-wrongtype 0.6) points to "
                   "fixture_wrongtype_plugin:NOT_A_CLASS, which is not a CopyService subclass"},
    ]


def test_entry_point_plugin_hook_is_called(plugin_fixtures):
    plugin_fixtures("good_plugins")
    pm = get_plugin_manager()
    assert pm.hook.reshard_plan_tensor(entry="e", rank=3, context=None) == ("hooked", "e", 3)


def test_broken_plugin_is_recorded_and_everything_else_keeps_working(plugin_fixtures):
    plugin_fixtures("broken_plugin", "good_plugins")
    records = {r.name: r for r in plugin_records()}
    assert records["broken"] == PluginRecord(
        "broken", "broken-reshard-plugin", "0.1", status="error", reason="RuntimeError: broken on purpose"
    )
    assert records["hooked"].status == "unavailable"
    pm = get_plugin_manager()
    assert pm.hook.reshard_plan_tensor(entry="e", rank=0, context=None) == ("hooked", "e", 0)


def test_strict_mode_raises_naming_plugin_and_error(plugin_fixtures, monkeypatch):
    plugin_fixtures("broken_plugin")
    monkeypatch.setenv("RESHARD_STRICT_PLUGINS", "1")
    expected = (
        r"^plugin 'broken' \(broken-reshard-plugin 0\.1\) failed to load: "
        r"RuntimeError: broken on purpose \(RESHARD_STRICT_PLUGINS=1\)$"
    )
    with pytest.raises(PluginError, match=expected):
        get_plugin_manager()
    with pytest.raises(PluginError, match=expected):
        plugin_records()


def test_strict_mode_raises_for_a_transport_that_fails_to_load(plugin_fixtures, monkeypatch):
    plugin_fixtures("good_plugins")
    monkeypatch.setenv("RESHARD_STRICT_PLUGINS", "1")
    monkeypatch.setenv("RESHARD_DISABLE_PLUGINS", "notservice")
    get_plugin_manager()  # loading is fine: transports are probed only when listed
    with pytest.raises(PluginError, match=r"^transport 'missing' \(fixture-transports 0\.3\) failed to load: "
                                          r"ModuleNotFoundError: No module named 'fixture_transport_missing' "
                                          r"\(RESHARD_STRICT_PLUGINS=1\)$"):
        plugin_records()


def test_strict_mode_off_values_and_bad_value(plugin_fixtures, monkeypatch):
    plugin_fixtures("broken_plugin")
    monkeypatch.setenv("RESHARD_STRICT_PLUGINS", "0")
    assert [r.status for r in plugin_records()] == ["error"]
    monkeypatch.setenv("RESHARD_STRICT_PLUGINS", "maybe")
    with pytest.raises(PluginError, match=r"^RESHARD_STRICT_PLUGINS must be 0 or 1, got 'maybe'$"):
        get_plugin_manager()


def test_disabled_plugins_are_skipped_without_import(plugin_fixtures, monkeypatch):
    plugin_fixtures("broken_plugin", "good_plugins")
    monkeypatch.setenv("RESHARD_DISABLE_PLUGINS", " broken, hooked ,missing,notservice,")
    monkeypatch.setenv("RESHARD_STRICT_PLUGINS", "1")  # disabled broken plugins are not failures
    pm = get_plugin_manager()
    assert "fixture_hooked_plugin" not in sys.modules
    assert not pm.has_plugin("hooked") and not pm.has_plugin("broken")
    records = records_as_dicts()
    assert [(r["name"], r["status"]) for r in records] == [
        ("beta", "unavailable"), ("broken", "disabled"), ("heavy", "available"), ("hooked", "disabled"),
        ("missing", "disabled"), ("notservice", "disabled"),
    ]
    assert records[1] == {"name": "broken", "distribution": "broken-reshard-plugin", "version": "0.1",
                          "transports": [], "hooks": [], "status": "disabled",
                          "reason": "disabled by RESHARD_DISABLE_PLUGINS"}
    assert records[3] == {"name": "hooked", "distribution": "fixture-hooked", "version": "0.2",
                          "transports": ["alpha"], "hooks": [], "status": "disabled",
                          "reason": "disabled by RESHARD_DISABLE_PLUGINS"}


def test_api_mismatch_missing_declaration_unknown_hook_and_raising_probe(plugin_fixtures):
    plugin_fixtures("api_plugins")
    assert records_as_dicts() == [
        {"name": "noapi", "distribution": "fixture-api-plugins", "version": "0.2", "transports": [],
         "hooks": ["reshard_plan_tensor"], "status": "incompatible",
         "reason": "does not declare RESHARD_PLUGIN_API; this reshard-core provides plugin API 1"},
        {"name": "oldapi", "distribution": "fixture-api-plugins", "version": "0.2", "transports": [],
         "hooks": ["reshard_plan_tensor"], "status": "incompatible",
         "reason": "targets plugin API 0; this reshard-core provides plugin API 1"},
        {"name": "raising", "distribution": "fixture-api-plugins", "version": "0.2", "transports": [],
         "hooks": [], "status": "error", "reason": "unavailable_reason() raised ValueError: probe exploded"},
        {"name": "typo", "distribution": "fixture-api-plugins", "version": "0.2", "transports": [],
         "hooks": ["reshard_plan_tensr"], "status": "error",
         "reason": "implements unknown hook(s): reshard_plan_tensr"},
    ]
    # None of the rejected plugins was registered.
    pm = get_plugin_manager()
    assert [name for name in ("noapi", "oldapi", "raising", "typo") if pm.has_plugin(name)] == ["raising"]
    planners = {impl.plugin_name for impl in pm.hook.reshard_plan_tensor.get_hookimpls()}
    assert not planners & {"noapi", "oldapi", "typo"}


def test_incompatible_plugin_fails_strict_mode(plugin_fixtures, monkeypatch):
    plugin_fixtures("api_plugins")
    monkeypatch.setenv("RESHARD_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=r"^plugin 'noapi' \(fixture-api-plugins 0\.2\) is incompatible: "
                                          r"does not declare RESHARD_PLUGIN_API; this reshard-core provides "
                                          r"plugin API 1 \(RESHARD_STRICT_PLUGINS=1\)$"):
        get_plugin_manager()


def test_two_distributions_claiming_one_plugin_or_transport_name(plugin_fixtures):
    plugin_fixtures("conflicts")
    twin = ("plugin name 'twin' is claimed by more than one distribution: "
            "fixture-conflict-a 0.1, fixture-conflict-b 0.2; uninstall all but one")
    dupe = ("transport name 'dupe' is claimed by more than one distribution: "
            "fixture-conflict-c 0.3, fixture-conflict-d 0.4; uninstall all but one")
    assert records_as_dicts() == [
        {"name": "dupe", "distribution": "fixture-conflict-d", "version": "0.4", "transports": ["dupe"],
         "hooks": [], "status": "error", "reason": dupe},
        {"name": "solo", "distribution": "fixture-conflict-c", "version": "0.3", "transports": ["dupe"],
         "hooks": [], "status": "error", "reason": dupe},
        {"name": "twin", "distribution": "fixture-conflict-a", "version": "0.1", "transports": [],
         "hooks": [], "status": "error", "reason": twin},
        {"name": "twin", "distribution": "fixture-conflict-b", "version": "0.2", "transports": [],
         "hooks": [], "status": "error", "reason": twin},
    ]


def test_in_process_plugin_is_called_first_and_listed(plugin_fixtures):
    plugin_fixtures("good_plugins")
    planner = Planner("in-process answer")
    assert register_plugin(planner, name="my-planner") == "my-planner"
    pm = get_plugin_manager()
    assert pm.hook.reshard_plan_tensor(entry="t", rank=5, context=None) == "in-process answer"
    assert planner.calls == [("t", 5)]
    mine = [r for r in plugin_records() if r.name == "my-planner"]
    assert mine == [PluginRecord("my-planner", None, None, hooks=("reshard_plan_tensor",))]
    # Declining (None) falls through to the entry-point plugin registered before it.
    planner.answer = None
    assert pm.hook.reshard_plan_tensor(entry="t", rank=1, context=None) == ("hooked", "t", 1)
    unregister_plugin("my-planner")
    assert [r.name for r in plugin_records()] == ["beta", "heavy", "hooked", "missing", "notservice"]
    with pytest.raises(PluginError, match=r"^no in-process plugin named 'my-planner' is registered$"):
        unregister_plugin("my-planner")


def test_in_process_registration_errors(plugin_fixtures):
    plugin_fixtures("good_plugins")
    with pytest.raises(PluginError, match=r"^cannot register plugin 'hooked': that name is already in use$"):
        register_plugin(Planner(1), name="hooked")

    class Old(Planner):
        RESHARD_PLUGIN_API = 7

    with pytest.raises(PluginError, match=r"^plugin 'Old' targets plugin API 7; "
                                          r"this reshard-core provides plugin API 1$"):
        register_plugin(Old(1))

    class Nothing:
        def reshard_plan_tensor(self, entry, rank):
            return 1

    with pytest.raises(PluginError, match=r"^plugin 'Nothing' implements no reshard hook "
                                          r"\(mark functions with @hookimpl\)$"):
        register_plugin(Nothing())

    class Typo:
        @hookimpl
        def reshard_extract_tensr(self, qualname):
            return 1

    with pytest.raises(PluginError, match=r"^plugin 'Typo' implements unknown hook\(s\): "
                                          r"reshard_extract_tensr$"):
        register_plugin(Typo())

    class BadArgs:
        @hookimpl
        def reshard_plan_tensor(self, entry, rank, not_an_argument):
            return 1

    with pytest.raises(PluginError, match=r"^cannot register plugin 'BadArgs': PluginValidationError: "
                                          r"Plugin 'BadArgs' for hook 'reshard_plan_tensor'"):
        register_plugin(BadArgs())


def test_builtins_registered_first_so_plugins_win(plugin_fixtures, monkeypatch):
    plugin_fixtures("modules")
    monkeypatch.setattr("reshard_core.plugins.BUILTIN_HOOK_MODULES", ("fixture_builtin_hooks",))
    pm = get_plugin_manager()
    assert pm.hook.reshard_plan_tensor(entry="t", rank=0, context=None) == "builtin"
    planner = Planner("plugin")
    register_plugin(planner)
    assert pm.hook.reshard_plan_tensor(entry="t", rank=0, context=None) == "plugin"
    planner.answer = None
    assert pm.hook.reshard_plan_tensor(entry="t", rank=0, context=None) == "builtin"
    assert [r.to_dict() for r in plugin_records(include_builtin=True)] == [
        {"name": "Planner", "distribution": None, "version": None, "transports": [],
         "hooks": ["reshard_plan_tensor"], "status": "available", "reason": None},
        {"name": "fixture_builtin_hooks", "distribution": "reshard-core", "version": "0.1.0",
         "transports": [], "hooks": ["reshard_plan_tensor"], "status": "available", "reason": None},
    ]
    assert [r.name for r in plugin_records()] == ["Planner"]


def test_builtin_module_with_missing_dependency_is_a_real_error(plugin_fixtures, monkeypatch):
    plugin_fixtures("modules")
    monkeypatch.setattr("reshard_core.plugins.BUILTIN_HOOK_MODULES", ("fixture_builtin_broken",))
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'fixture_no_such_dependency'$"):
        get_plugin_manager()


def test_a_missing_builtin_module_is_a_real_error(plugin_fixtures, monkeypatch):
    """No built-in hook module is optional: a mistyped or missing one fails, it is never skipped."""
    plugin_fixtures("modules")
    monkeypatch.setattr("reshard_core.plugins.BUILTIN_HOOK_MODULES", ("reshard_core.not_a_module",))
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'reshard_core.not_a_module'$"):
        get_plugin_manager()


def test_plugin_manager_is_a_singleton_until_reset(fresh_plugin_manager):
    from reshard_core.plugins import reset_plugin_manager

    pm = get_plugin_manager()
    assert get_plugin_manager() is pm
    reset_plugin_manager()
    assert get_plugin_manager() is not pm
