"""Argument types the command line's subcommands share (cli.py, cli_serving.py): each checks its value
as it is parsed, so a mistake is one `error:` line before any model is loaded."""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

_GRAPHS = {"auto": None, "on": True, "off": False, "decode": "decode"}  # --cuda-graphs -> generate's cuda_graphs


def _int(low: int, high: int = 2**63 - 1):
    def parse(arg: str) -> int:
        try:
            value = int(arg)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            allowed = f">= {low}" if high == 2**63 - 1 else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be an integer {allowed} (at most 2**63 - 1), got {arg!r}")
        return value
    return parse


def _float(low: float, high: float = math.inf, low_open: bool = False):
    def parse(arg: str) -> float:
        try:
            value = float(arg)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
            raise argparse.ArgumentTypeError(f"must be a number in {'(' if low_open else '['}{low:g}, {high:g}], "
                                             f"got {arg!r}")
        return value
    return parse


def _writable(folder: str, flag: str = "--out") -> Path:
    """Create the folder of `flag` and write a file in it now: a bad path fails before the run, not after it."""
    out = Path(folder)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {folder!r} cannot be written: {e.strerror or e}") from None
    return out
