"""Where a serving run's time went: its busy periods, what each held, and Python's full garbage
collections as spans (notebook 08; scripts/timeline_bursts.py).

A serving run's timeline (core/timeline.py) holds every step's spans and each request's arrival as a
mark. `bursts(timeline)` cuts it into busy periods, `window(timeline, start, end)` sums one up, and
`gc_pauses(timeline)` records the collector's stops, which look like an idle device from the inside.
"""

from __future__ import annotations

import bisect
import gc
from contextlib import contextmanager

from ..core.timeline import DEVICE_LANES, Timeline, merged, union_length


@contextmanager
def gc_pauses(timeline: Timeline):
    """Inside, each of Python's full garbage collections (generation 2) becomes a "gc" span on the
    CPU lane. A full collection walks every object the collector tracks, and whichever thread runs
    it holds the interpreter lock meanwhile: with torch and a model loaded, every Python thread
    (a server's loop and its HTTP thread) stops for as long as it takes. The young generations'
    collections are frequent and short, and left out."""
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            started.append(timeline.now())
        elif started:
            timeline.add("CPU", "gc", started.pop(), timeline.now())

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)


def bursts(timeline: Timeline, quiet: float = 0.5) -> list[tuple[float, float]]:
    """A serving run's busy periods, as (start, end): from the first arrival of a group of requests
    to the end of the last device span after it, where a group ends at a gap of `quiet` seconds
    with no arrival and nothing on any lane (an idle server's warm-up and its loads apart; a long
    host stall, such as a garbage collection, stays inside its burst)."""
    arrivals = timeline.arrivals()
    device = sorted((s.start, s.end) for s in timeline.spans if s.lane in DEVICE_LANES)
    events = [(t, t) for t in arrivals] + [(s.start, s.end) for s in timeline.spans]
    out = []
    for a, b in merged(events, bridge=quiet):
        first = bisect.bisect_left(arrivals, a)
        if first < len(arrivals) and arrivals[first] <= b:  # a period with no arrival is no burst
            inside = device[bisect.bisect_left(device, (a, a)):bisect.bisect_right(device, (b, b))]
            last = arrivals[bisect.bisect_right(arrivals, b) - 1]
            out.append((arrivals[first], max([e for _, e in inside] + [last])))
    return out


def window(timeline: Timeline, start: float, end: float) -> dict:
    """What happened between `start` and `end` (seconds on the timeline): arrivals and their spread,
    steps computed, the device's busy share, the mean wall time per step and compute span, and the
    seconds of full garbage collections (`gc_pauses`) in it."""
    spans = timeline.spans
    arrivals = timeline.arrivals(start, end)
    compute = [s for s in spans if s.lane == "compute" and start <= s.start < end]
    device = [(max(s.start, start), min(s.end, end)) for s in spans
              if s.lane in DEVICE_LANES and s.end > start and s.start < end]
    wall, steps = end - start, len({s.step for s in compute})
    return {"wall_s": wall, "arrivals": len(arrivals),
            "arrival_spread_s": arrivals[-1] - arrivals[0] if arrivals else 0.0,
            "steps": steps, "device_busy": union_length(device) / wall if wall > 0 else 0.0,
            "ms_per_step": 1000 * wall / steps if steps else 0.0,
            "compute_ms": 1000 * sum(s.duration for s in compute) / len(compute) if compute else 0.0,
            "gc_s": sum(min(s.end, end) - max(s.start, start) for s in spans
                        if s.name == "gc" and s.end > start and s.start < end)}
