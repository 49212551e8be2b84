"""What the `cpu` device process already holds, and how each object of device work travels there.

Work launched on the cpu device (devices/cpu.py) is pickled; this module decides, object by object,
what goes by value and what by name (devices/cpu_process.py rebuilds both):

    a tensor in shared memory (dev.empty, dev.pin)  -> view(storage key, offset, shape, stride)
    a plain host tensor                               -> refused: a GPU cannot read pageable memory either
    a resident object (a model, a KV cache, a step runner: `core.device.resident_types`)
        inherited by the fork                         -> its address, the same in the child
        sent before and still alive                   -> its key
        new                                           -> by value once, then remembered by key
    anything else                                     -> by value (pickle's default)

When a shared storage or a remembered object dies on the host, its key is queued as dropped, and
the next message tells the device process to let go of its copy. The death is noticed by a weak
reference whose callback is a C function (a deque's `append`): a callback written in Python runs
wherever the last reference goes, and a Ctrl-C landing in it would be swallowed by the interpreter
("Exception ignored in ...") with the record half updated. The bookkeeping happens later, in plain
code (`_purge`), before the record is read.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque

import torch

from . import cpu_process as device_process
from ..core.device import resident_types
from ..core.device import DeviceError


class Names:
    """The host's record of the device process's storages and objects, by key."""

    def __init__(self, inherit=()) -> None:
        self._keys = itertools.count(1)
        self.storage_keys: dict[int, int] = {}  # data_ptr of a shared storage -> its key
        self.sent: dict[int, tuple] = {}  # id(obj) -> (weak reference, key) of objects sent by value
        self.dropped_storages: list[int] = []
        self.dropped_objects: list[int] = []
        # id(weak reference) -> (the reference, kind "storage" or "object", data_ptr or id(obj), key); a
        # reference found dead lands in `_dead` (its callback is `_dead.append`), purged by `_purge`
        self._watched: dict[int, tuple] = {}
        self._dead: deque = deque()
        # the objects in `inherit` (and the torch modules they hold) are inherited by the fork, so the
        # device names them by address instead of receiving a copy (a scan of every object for them
        # took longer than the fork itself)
        self.forked: dict[int, weakref.ref] = {}
        for obj in inherit:
            held = [v for v in vars(obj).values() if isinstance(v, torch.nn.Module)] if hasattr(obj, "__dict__") else []
            for o in [obj, *held, *(m for h in held for m in h.modules())]:
                self.forked[id(o)] = weakref.ref(o)

    def new_key(self) -> int:
        """A key no storage, object, event or timeline of this device has had."""
        return next(self._keys)

    def add_storage(self, tensor: torch.Tensor, key: int) -> None:
        """`tensor`'s shared storage is known to the device process as `key` (until the tensor dies)."""
        ptr = tensor.untyped_storage().data_ptr()
        self._purge()  # (a dead storage's address may be this one's: its entry goes first)
        # views keep their base alive, so the storage is dropped when the last view goes; watched before
        # it is named, so that an interrupt in between leaves no name that nothing would ever remove
        ref = weakref.ref(tensor, self._dead.append)
        self._watched[id(ref)] = (ref, "storage", ptr, key)
        self.storage_keys[ptr] = key

    def take_dropped(self) -> tuple[list[int], list[int]] | None:
        """The storage and object keys dropped since the last call (None if there are none)."""
        self._purge()
        if not (self.dropped_storages or self.dropped_objects):
            return None
        storages, objects = self.dropped_storages[:], self.dropped_objects[:]
        # (a purge in another thread may append while we copy: delete only what was taken)
        del self.dropped_storages[:len(storages)], self.dropped_objects[:len(objects)]
        return storages, objects

    def reference(self, obj, pickler):
        """How an object travels to the device process (devices/cpu_process.py): None means by value."""
        if self._dead:  # a dead storage's address may be reused by this tensor's
            self._purge()
        if isinstance(obj, torch.Tensor):
            if obj.numel() == 0:
                return None
            key = self.storage_keys.get(obj.untyped_storage().data_ptr())
            if key is not None:
                return device_process.view, (key, obj.storage_offset(), tuple(obj.shape), obj.stride(), obj.dtype)
            if pickler.inside_resident:
                return None  # e.g. a model's weights, when the model is sent by value
            raise DeviceError("device work got a plain host tensor (shape " + str(tuple(obj.shape)) + "); the "
                              "device cannot reach pageable host memory, as a GPU kernel cannot: allocate it "
                              "with dev.empty (device memory) or dev.pin (host memory the device reaches)")
        if isinstance(obj, resident_types()):
            i = id(obj)
            ref = self.forked.get(i)
            if ref is not None and ref() is obj:
                return device_process.forked, (i,)
            entry = self.sent.get(i)
            if entry is not None and entry[0]() is obj:
                return device_process.named, (entry[1],)
            key = self.new_key()
            data = device_process.dumps(obj, self, top=obj, inside_resident=True, pending=pickler.pending)
            pickler.pending.append((obj, key))
            return device_process.named_new, (key, data)
        return None

    def remember(self, obj, key: int) -> None:
        """`obj` has been delivered by value as `key`: name it from now on, and drop it when it dies."""
        i = id(obj)
        try:
            ref = weakref.ref(obj, self._dead.append)
            self._watched[id(ref)] = (ref, "object", i, key)
        except TypeError:  # cannot be weakly referenced: kept alive with the device
            ref = (lambda o: lambda: o)(obj)
        self.sent[i] = (ref, key)

    def _purge(self) -> None:
        """Forget what died since the last purge, and queue its keys as dropped. An entry is removed only
        if it is still the dead one's: a new storage at the same address, or a new object with the same
        id, has its own. A dead reference leaves `_dead` last, so an interrupt half-way through repeats
        its purge next time (the device process lets go of a key twice without harm), never skips it."""
        while self._dead:
            ref = self._dead[0]
            entry = self._watched.get(id(ref))
            if entry is not None:
                _, kind, where, key = entry
                table, dropped = ((self.storage_keys, self.dropped_storages) if kind == "storage"
                                  else (self.sent, self.dropped_objects))
                held = table.get(where)
                if held is not None and (held if kind == "storage" else held[1]) == key:
                    del table[where]
                dropped.append(key)
                self._watched.pop(id(ref), None)
            if self._dead and self._dead[0] is ref:  # (a purge re-entered from here may have taken it)
                self._dead.popleft()
