"""The device layer's weak records: what the cpu device process holds (devices/names.py) and which
devices are open (devices/lifecycle.OpenDevices). A death is noticed without running Python code, where
a Ctrl-C could land and be swallowed, and the records are still brought up to date."""

import gc
import sys

import pytest
import torch

from minibatch.devices.lifecycle import OpenDevices
from minibatch.devices.names import Names


class Held:
    """An object that travels by value once and is named by key after (weakly referenced)."""


def profiled_calls(action) -> list[str]:
    """The Python functions that run while `action()` does (the action itself apart)."""
    calls = []

    def seen(frame, event, arg):
        if event == "call" and frame.f_code is not action.__code__:
            calls.append(frame.f_code.co_qualname)

    sys.setprofile(seen)
    try:
        action()
    finally:
        sys.setprofile(None)
    return calls


def test_dropped_storages_and_objects_are_queued_for_the_device():
    names = Names()
    t = torch.empty(16).share_memory_()
    names.add_storage(t, 5)
    view = t[4:]  # a view keeps its base, and so the storage, alive
    obj = Held()
    names.remember(obj, 7)
    assert names.take_dropped() is None
    del t
    gc.collect()
    assert names.take_dropped() is None, "the view still holds the storage"
    del obj
    assert names.take_dropped() == ([], [7]) and not names.sent
    del view
    assert names.take_dropped() == ([5], []) and not names.storage_keys
    assert names.take_dropped() is None


def test_a_death_runs_no_python_code():
    """A Python callback runs wherever the last reference goes, and a Ctrl-C that lands in it is
    swallowed by the interpreter ("Exception ignored in ..."), its bookkeeping half done. The callbacks
    are C functions; the keys are handed over later, by plain code."""
    names = Names()
    holder = {"t": torch.empty(8).share_memory_(), "obj": Held()}
    names.add_storage(holder["t"], 1)
    names.remember(holder["obj"], 2)
    assert profiled_calls(lambda: holder.__delitem__("t")) == []
    assert profiled_calls(lambda: holder.__delitem__("obj")) == []
    assert names.take_dropped() == ([1], [2])


def test_a_purge_cut_short_is_repeated_not_skipped():
    """An interrupt in the middle of handing over the dead keys repeats the hand-over next time (the
    device process lets go of a key twice without harm); it never loses a key."""
    class Cut(dict):
        """The record of sent objects; the interrupt lands as the dead one's entry is removed, before
        its key is queued."""
        cut = True

        def __delitem__(self, key):
            if self.cut:
                self.cut = False
                raise KeyboardInterrupt
            super().__delitem__(key)

    names = Names()
    names.sent = Cut()
    obj = Held()
    names.remember(obj, 3)
    del obj
    with pytest.raises(KeyboardInterrupt):
        names.take_dropped()
    assert names.take_dropped() == ([], [3]) and not names.sent and not names._dead and not names._watched


def test_the_open_devices_are_held_weakly_and_forgotten_without_python_code():
    """A device dropped unclosed leaves the registry that closes devices at exit (and disowns them in a
    fork); its weak-set callback would run Python code where the last reference went."""
    devices = OpenDevices()
    holder = {"a": Held(), "b": Held()}
    devices.add(holder["a"])
    devices.add(holder["b"])
    assert set(map(id, devices)) == {id(holder["a"]), id(holder["b"])}
    devices.discard(holder["b"])  # closed
    assert list(devices) == [holder["a"]]
    assert profiled_calls(lambda: holder.__delitem__("a")) == []
    assert list(devices) == []

