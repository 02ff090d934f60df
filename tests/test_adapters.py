"""The scheduler's adapter table: slots, users, unloading after the last user, namespaces."""

from __future__ import annotations

import pytest

from service.core.scheduler.adapters import AdapterTable, AdapterUnavailableError


def table(*names: str) -> AdapterTable:
    t = AdapterTable()
    for name in names:
        t.add(name, t.free_slot())
    return t


def test_slots_start_at_one_and_names_are_unique() -> None:
    t = table("sql", "chat")
    assert [t.get(n).slot for n in ("sql", "chat")] == [1, 2]  # type: ignore[union-attr]
    assert t.served == ["sql", "chat"]
    with pytest.raises(ValueError, match="already loaded"):
        t.add("sql", 3)
    with pytest.raises(ValueError, match="taken"):
        t.add("other", 2)


def test_an_unknown_name_is_refused_naming_the_served_ones() -> None:
    t = table("sql", "chat")
    with pytest.raises(
        AdapterUnavailableError, match="'nope' is not served; served adapters: sql, chat"
    ):
        t.acquire("nope")
    with pytest.raises(AdapterUnavailableError, match="served adapters: none"):
        AdapterTable().acquire("sql")


def test_unloading_waits_for_the_last_user() -> None:
    t = table("sql", "chat")
    first, second = t.acquire("sql"), t.acquire("sql")
    assert t.unload("sql") == 2
    assert t.served == ["chat"]
    with pytest.raises(AdapterUnavailableError, match="being unloaded"):
        t.acquire("sql")
    t.release(first)
    assert t.take_unloaded() == [] and not t.unload_pending
    assert t.free_slot() == 3  # slot 1 is still held
    t.release(second)
    assert t.unload_pending and "sql" not in t
    assert t.free_slot() == 3  # until the runner has been told to clear slot 1
    assert t.take_unloaded() == [1]
    assert t.free_slot() == 1


def test_an_unused_adapter_unloads_at_once_and_twice_is_refused() -> None:
    t = table("sql")
    assert t.unload("sql") == 0
    assert t.take_unloaded() == [1]
    with pytest.raises(AdapterUnavailableError, match="no adapter named 'sql'"):
        t.unload("sql")


def test_each_load_is_its_own_prefix_namespace() -> None:
    t = table("sql", "chat")
    first = t.get("sql")
    assert first is not None and first.root != t.get("chat").root  # type: ignore[union-attr]
    t.unload("sql")
    t.take_unloaded()
    again = t.add("sql", t.free_slot())
    assert again.slot == first.slot and again.root != first.root


def test_a_release_without_acquire_is_a_bug() -> None:
    t = table("sql")
    entry = t.get("sql")
    assert entry is not None
    with pytest.raises(ValueError, match="released more often"):
        t.release(entry)
