"""Argument helpers every layer uses: integers, numbers and flags checked with errors that name the
argument, the dtypes and devices minibatch accepts, and `resolve_device` (notebook 00).

They sit at the bottom of the package (below the devices) so that the model's load checks
(model/checks.py) and the run's checks (core/checks.py) share one definition of "an integer".
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

DEVICES = ("cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INT64_MAX = 2**63 - 1  # seeds and top_k travel to the device as int64 (core/batch.py)


def _int(name: str, value: Any, low: int | None = 1, high: int | None = None) -> int:
    """An int (a Python or numpy integer, not a bool or a float such as 2.0) in [low, high]."""
    allowed = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r} ({type(value).__name__})")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    return int(value)


def _number(name: str, value: Any, allowed: str, ok=lambda v: True) -> float:
    """A finite real number (ints accepted, bools and strings not) for which ok(value) holds."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be a finite number {allowed}, got {value!r} ({type(value).__name__})")
    return float(value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def resolve_device(device: str | torch.device | None) -> torch.device:
    """'auto'/None -> cuda if available else cpu; 'cpu:0' -> cpu; anything else must be a present device."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a string such as 'cpu' or 'cuda:0', a torch.device or None, got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"unknown device {device!r}: use one of {DEVICES} or 'auto'") from e
    if dev.type not in DEVICES:
        raise ValueError(f"unknown device {device!r}: use one of {DEVICES} or 'auto'")
    if dev.type == "cpu":
        return torch.device("cpu")  # one CPU device: an index means nothing to the cpu backend
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but this PyTorch build sees no CUDA GPU")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} asked for, but only {torch.cuda.device_count()} GPU(s) are visible")
    return dev
