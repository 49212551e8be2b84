"""Timelines: who was busy when (notebook 01 onward).

A `Timeline` is a list of spans, each on a lane:

    CPU      ██prepare██                    ██update██ ██prepare██
    H2D                 █                                        █
    compute              ████forward+sample████                   ████ …
    D2H                                        █

The loops record a span for every stage of every step. `device_busy()` is the fraction of the
wall time during which at least one device lane (H2D, compute, D2H) was busy: the number the
article reports (76.0% synchronous, 99.4% asynchronous). A serving run's timeline also marks each
request's arrival (serving/diagnostics.py cuts it into busy periods). `plot()` draws the Gantt chart;
`to_chrome_trace()` writes JSON that chrome://tracing and ui.perfetto.dev open.

Times are seconds on the host's `time.perf_counter()` clock, relative to the timeline's start.
"""

from __future__ import annotations

import gzip
import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

LANES = ("CPU", "H2D", "compute", "D2H")
ARRIVAL = "request "  # the label of a request's arrival mark, before its id
DEVICE_LANES = ("H2D", "compute", "D2H")
COLORS = {"prepare": "#4C72B0", "update": "#55A868", "H2D": "#C44E52", "compute": "#8172B2",
          "D2H": "#CCB974", "wait": "#BBBBBB", "delay": "#E1812C", "gc": "#000000"}


@dataclass
class Span:
    lane: str
    name: str
    start: float
    end: float
    step: int = -1
    slot: int = -1

    @property
    def duration(self) -> float:
        return self.end - self.start


class Timeline:
    """Spans on lanes, and marks (a request's arrival, notebook 08) at points in time.

    `limit` bounds the spans kept (a serving engine runs for hours): past twice the limit the oldest
    half is dropped, so appending stays cheap.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.t0 = time.perf_counter()
        self.spans: list[Span] = []
        self.marks: list[tuple[float, str]] = []  # (time, label)
        self.limit = limit

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, lane: str, name: str, start: float, end: float, step: int = -1, slot: int = -1) -> None:
        self.spans.append(Span(lane, name, start, end, step, slot))
        if self.limit is not None and len(self.spans) > 2 * self.limit:
            # down to the newest `limit`, however many got here at once (spans come from any thread)
            del self.spans[: len(self.spans) - self.limit]

    def mark(self, label: str, at: float | None = None) -> None:
        """A point in time worth seeing on the plot, e.g. a request's arrival (`at`: perf_counter seconds)."""
        self.marks.append(((self.now() if at is None else at - self.t0), label))
        if self.limit is not None and len(self.marks) > 2 * self.limit:
            del self.marks[: len(self.marks) - self.limit]

    def arrivals(self, start: float = float("-inf"), end: float = float("inf")) -> list[float]:
        """Times of the requests' arrivals (marks "request N") between start and end, in order; a serving
        run also marks when each was scheduled ("scheduled N") and its first token delivered ("first N")."""
        return sorted(t for t, label in self.marks if start <= t <= end and label.startswith(ARRIVAL))

    def request_marks(self) -> dict[str, dict[str, float]]:
        """{request id: {"request": arrival, "scheduled": admission, "first": first token}} from the marks
        (a serving run's; a request still waiting has its arrival only)."""
        out: dict[str, dict[str, float]] = {}
        for t, label in self.marks:
            kind, _, rid = label.partition(" ")
            out.setdefault(rid, {})[kind] = t
        return out

    @contextmanager
    def span(self, lane: str, name: str, step: int = -1, slot: int = -1):
        start = self.now()
        try:
            yield
        finally:
            self.add(lane, name, start, self.now(), step, slot)

    # --- summaries -------------------------------------------------------------------------------
    @property
    def wall(self) -> float:
        if not self.spans:
            return 0.0
        return max(s.end for s in self.spans) - min(s.start for s in self.spans)

    def busy(self, lanes=DEVICE_LANES) -> float:
        """Seconds during which at least one of `lanes` was busy (union of their spans)."""
        return union_length((s.start, s.end) for s in self.spans if s.lane in lanes)

    def device_busy(self) -> float:
        """Fraction of wall time with the device doing something (H2D, compute or D2H)."""
        return self.busy() / self.wall if self.wall > 0 else 0.0

    def totals(self) -> dict[str, float]:
        """Seconds per span name, e.g. {'prepare': 0.1, 'compute': 0.8, ...}."""
        out: dict[str, float] = {}
        for s in self.spans:
            out[s.name] = out.get(s.name, 0.0) + s.duration
        return out

    # --- export ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = {"spans": [asdict(s) for s in self.spans]}
        if self.marks:
            out["marks"] = [list(m) for m in self.marks]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Timeline":
        tl = cls()
        tl.spans = [Span(**s) for s in d["spans"]]
        tl.marks = [(float(t), str(label)) for t, label in d.get("marks", [])]
        return tl

    def save(self, path) -> None:
        """JSON; gzipped where the name ends in .gz (how recorded runs keep their larger timelines)."""
        with _open(path, "w") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def load(cls, path) -> "Timeline":
        """What `save` wrote (a .gz name: gzipped JSON)."""
        with _open(path, "r") as f:
            return cls.from_dict(json.load(f))

    def to_chrome_trace(self, path) -> None:
        """Chrome trace-event JSON (open in ui.perfetto.dev): one thread per lane, times in µs."""
        tid = {lane: i for i, lane in enumerate(LANES)}
        events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": lane}}
                  for lane, i in tid.items()]
        for s in self.spans:
            events.append({"name": s.name, "ph": "X", "pid": 0, "tid": tid.get(s.lane, len(LANES)),
                           "ts": s.start * 1e6, "dur": s.duration * 1e6,
                           "args": {"step": s.step, "slot": s.slot}})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)

    # --- drawing ---------------------------------------------------------------------------------
    def plot(self, ax=None, title: str | None = None, start: float | None = None, end: float | None = None,
             step_labels: bool = False):
        """Gantt chart of the spans between start and end (seconds; default: everything).

        The legend lists only the kinds of span drawn in that window. step_labels writes each span's
        step number on it where the bar is wide enough to hold it.
        """
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        if ax is None:
            _, ax = plt.subplots(figsize=(10, 2.4))
        present = list(dict.fromkeys(s.lane for s in self.spans))
        lanes = [lane for lane in LANES if lane in present] + [lane for lane in present if lane not in LANES]
        t_lo = min(s.start for s in self.spans) if start is None else start
        t_hi = max(s.end for s in self.spans) if end is None else end
        drawn = [s for s in self.spans if s.end >= t_lo and s.start <= t_hi]
        for row, lane in enumerate(lanes):
            bars = [(s.start - t_lo, s.duration, COLORS.get(s.name, "#999999")) for s in drawn if s.lane == lane]
            if bars:
                ax.broken_barh([(a, d) for a, d, _ in bars], (row - 0.4, 0.8),
                               facecolors=[c for *_, c in bars], edgecolor="none")
        if step_labels:
            row_of = {lane: row for row, lane in enumerate(lanes)}
            for s in drawn:
                visible = min(s.end, t_hi) - max(s.start, t_lo)
                if s.step >= 0 and visible >= 0.025 * (t_hi - t_lo):
                    ax.text((max(s.start, t_lo) + min(s.end, t_hi)) / 2 - t_lo, row_of[s.lane], str(s.step),
                            ha="center", va="center", fontsize=8, color="white" if s.name != "wait" else "black")
        arrivals = [t - t_lo for t in self.arrivals(t_lo, t_hi)]
        if arrivals:  # above the CPU lane: when each request reached the engine
            ax.plot(arrivals, [-0.45] * len(arrivals), "v", color="black", markersize=5, clip_on=False,
                    label="arrival")
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_ylim(len(lanes) - 0.5, -0.5)
        ax.set_xlim(0, t_hi - t_lo)
        ax.set_xlabel("time (s)")
        names = {s.name for s in drawn}
        by_colour: dict[str, list[str]] = {}  # one entry per colour drawn; names without a colour share grey
        for n in [n for n in COLORS if n in names] + sorted(n for n in names if n not in COLORS):
            by_colour.setdefault(COLORS.get(n, "#999999"), []).append(n)
        handles = [Patch(color=c, label=", ".join(ns)) for c, ns in by_colour.items()]
        if arrivals:
            from matplotlib.lines import Line2D

            handles.append(Line2D([], [], marker="v", color="black", linestyle="none", label="arrival"))
        ax.legend(handles=handles,
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
        busy = self.device_busy()
        ax.set_title(title or f"device busy {busy:.0%} of the time")
        return ax


def _open(path, mode: str):
    return gzip.open(path, mode + "t") if str(path).endswith(".gz") else open(path, mode)


def merged(intervals, bridge: float = 0.0) -> list[tuple[float, float]]:
    """(start, end) intervals merged where they overlap, touch, or leave a gap of at most `bridge`."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1] + bridge:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def union_length(intervals, bridge: float = 0.0) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once; gaps shorter than
    `bridge` count as covered (0: only overlapping or touching intervals merge)."""
    return sum(b - a for a, b in merged(intervals, bridge))
