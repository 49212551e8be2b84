"""The private CPython hook the core uses, one function (tests/test_compat.py).

Each function says why it is needed, what it relies on, and what it does on the PyTorch versions the
project runs on (2.13 on the CPU, 2.11 on the GPU machine of BENCHMARKS.md); tests/test_compat.py
checks every hook of the package on whichever version is installed, so running it under another one
says which hooks still hold. minibatch keeps to public APIs where one exists; where none does, the
hook lives in the compat.py of the folder that needs it (core/, devices/, speed/), so that a new
PyTorch or Python version breaks one function with a name and a test, not a loop far away.

    referenced_elsewhere   reference counts as a copy-on-write test                 core/decode_keys.py

It imports only the standard library.
"""

from __future__ import annotations

import sys

__all__ = ["referenced_elsewhere"]


def referenced_elsewhere(obj, owners: int = 1) -> bool:
    """True if anything besides `owners` known references (list items, attributes) holds `obj`.

    Why: the decode key table (core/decode_keys.py) hands out views of its arrays; while a caller
    still holds a batch built on them, the next step must write to a copy (copy on write), and when
    none does it may write in place, which keeps the host's work per step O(rows). numpy tracks no
    views, so the reference count of the base array is the test (a view holds its base). CPython's
    `sys.getrefcount` also counts the references the call itself makes (this function's argument,
    getrefcount's own), and how many those are differs between CPython versions; so the count of an
    object with exactly one owner is measured once, at import, through a function shaped like this one
    (`_BASELINE`: 3 on CPython 3.11), and `obj`'s count is compared with it.
    """
    return sys.getrefcount(obj) > _BASELINE + owners - 1


def _one_owner(obj) -> int:
    return sys.getrefcount(obj)  # (the same call as in referenced_elsewhere: the same extra references)


def _calibrate() -> int:
    holder = [object()]
    return _one_owner(holder[0])


_BASELINE = _calibrate()
