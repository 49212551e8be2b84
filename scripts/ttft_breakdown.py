"""Where each request's time to first token went, from a serving run's timeline.

    python scripts/ttft_breakdown.py TIMELINE.json [TIMELINE.json ...]

TIMELINE.json: what `python -m minibatch serve --timeline FILE` writes as it stops (scripts/gpu/serve_bench.sh
keeps one per server). The serving loop marks, for every request, its arrival at the engine ("request N":
the HTTP handler's submit), the moment the scheduler admitted it into a batch ("scheduled N") and the
moment its first token was handed to its stream ("first N"). Per request, from the engine's side:

    queued    arrival -> scheduled: waiting for the loop to take it (the turn under way) and for a seat
    to first  scheduled -> first token delivered: its prefill step(s), and in the async loop the step
              launched before the host waits for the one that sampled it
    steps     compute spans that started between its scheduling and its first token
    its step  the compute milliseconds of the step that admitted it (its prefill, beside the decode rows)

Prints the median and 90th percentile of each over all requests (a warm-up request included), and
the median compute milliseconds of all steps for scale.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minibatch.core.timeline import Timeline  # noqa: E402


def breakdown(tl: Timeline) -> list[dict]:
    """One row per request that got its first token: queued_ms, to_first_ms, steps, step_ms."""
    marks = tl.request_marks()
    compute = sorted((s.start, s.end, s.step) for s in tl.spans if s.lane == "compute")
    starts = [c[0] for c in compute]
    prepares = sorted((s.start, s.end, s.step) for s in tl.spans if s.lane == "CPU" and s.name == "prepare")
    step_ms = {step: (end - start) * 1e3 for start, end, step in compute}
    rows = []
    for m in marks.values():
        if not {"request", "scheduled", "first"} <= set(m):
            continue
        admitted = next((step for a, b, step in prepares if a <= m["scheduled"] <= b), None)
        steps = bisect.bisect_right(starts, m["first"]) - bisect.bisect_left(starts, m["scheduled"])
        rows.append({"queued_ms": (m["scheduled"] - m["request"]) * 1e3, "to_first_ms": (m["first"] - m["scheduled"]) * 1e3,
                     "steps": steps, "step_ms": step_ms.get(admitted, float("nan"))})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("timelines", nargs="+", type=Path)
    args = ap.parse_args()
    print(f"{'timeline':34} {'requests':>8}  {'queued ms':>13}  {'to first ms':>13}  {'steps':>9}  "
          f"{'its step ms':>13}  {'all steps ms':>12}")
    for path in args.timelines:
        tl = Timeline.load(path)
        rows = breakdown(tl)
        if not rows:
            print(f"{path.name:34} no request with its arrival, scheduling and first token marked")
            continue

        def cell(key: str) -> str:
            v = sorted(r[key] for r in rows if r[key] == r[key])
            return f"{statistics.median(v):6.1f} /{v[int(0.9 * (len(v) - 1))]:6.1f}" if v else "-"
        every = statistics.median([(s.end - s.start) * 1e3 for s in tl.spans if s.lane == "compute"] or [float("nan")])
        print(f"{path.name:34} {len(rows):8}  {cell('queued_ms'):>13}  {cell('to_first_ms'):>13}  {cell('steps'):>9}  "
              f"{cell('step_ms'):>13}  {every:12.2f}")
    print("(median / 90th percentile)")


if __name__ == "__main__":
    main()
