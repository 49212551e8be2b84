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
    held      from the end of that step's compute to the first token's delivery: the host was busy
              elsewhere (in the async loop, launching the next step before it waits for this one)

Prints the median and 90th percentile of each over all requests (a warm-up request included), and
the median compute milliseconds of all steps for scale; with --bursts, the same for each burst of
arrivals (arrivals more than --gap seconds apart start a new one: serve_bench.sh sends one per rate).
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
    """One row per request that got its first token: arrival (s), queued_ms, to_first_ms, steps, step_ms,
    held_ms."""
    marks = tl.request_marks()
    compute = sorted((s.start, s.end, s.step) for s in tl.spans if s.lane == "compute")
    starts = [c[0] for c in compute]
    prepares = sorted((s.start, s.end, s.step) for s in tl.spans if s.lane == "CPU" and s.name == "prepare")
    step_ms = {step: (end - start) * 1e3 for start, end, step in compute}
    step_end = {step: end for _, end, step in compute}
    rows = []
    for m in marks.values():
        if not {"request", "scheduled", "first"} <= set(m):
            continue
        admitted = next((step for a, b, step in prepares if a <= m["scheduled"] <= b), None)
        steps = bisect.bisect_right(starts, m["first"]) - bisect.bisect_left(starts, m["scheduled"])
        held = (m["first"] - step_end[admitted]) * 1e3 if admitted in step_end else float("nan")
        rows.append({"arrival": m["request"], "queued_ms": (m["scheduled"] - m["request"]) * 1e3,
                     "to_first_ms": (m["first"] - m["scheduled"]) * 1e3, "steps": steps,
                     "step_ms": step_ms.get(admitted, float("nan")), "held_ms": held})
    return rows


def bursts(rows: list[dict], gap: float) -> list[list[dict]]:
    """The rows grouped by arrival: a new group after a pause of more than `gap` seconds."""
    groups: list[list[dict]] = []
    for r in sorted(rows, key=lambda r: r["arrival"]):
        if not groups or r["arrival"] - groups[-1][-1]["arrival"] > gap:
            groups.append([])
        groups[-1].append(r)
    return groups


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("timelines", nargs="+", type=Path)
    ap.add_argument("--bursts", action="store_true", help="a line for each burst of arrivals too")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds without an arrival that end a burst")
    args = ap.parse_args(argv)
    keys = ("queued_ms", "to_first_ms", "steps", "step_ms", "held_ms")
    print(f"{'timeline':34} {'requests':>8}  {'queued ms':>13}  {'to first ms':>13}  {'steps':>9}  "
          f"{'its step ms':>13}  {'held ms':>13}  {'all steps ms':>12}")
    for path in args.timelines:
        tl = Timeline.load(path)
        rows = breakdown(tl)
        if not rows:
            print(f"{path.name:34} no request with its arrival, scheduling and first token marked")
            continue

        def cells(rows: list[dict]) -> str:
            out = []
            for key in keys:
                v = sorted(r[key] for r in rows if r[key] == r[key])
                out.append(f"{statistics.median(v):6.1f} /{v[int(0.9 * (len(v) - 1))]:6.1f}" if v else "-")
            return "  ".join(f"{c:>{9 if k == 'steps' else 13}}" for k, c in zip(keys, out))
        every = statistics.median([(s.end - s.start) * 1e3 for s in tl.spans if s.lane == "compute"] or [float("nan")])
        print(f"{path.name:34} {len(rows):8}  {cells(rows)}  {every:12.2f}")
        if args.bursts:
            for i, group in enumerate(bursts(rows, args.gap)):
                print(f"{'  burst ' + str(i) + ' at ' + format(group[0]['arrival'] - rows[0]['arrival'], '.1f') + ' s':34} "
                      f"{len(group):8}  {cells(group)}")
    print("(median / 90th percentile)")


if __name__ == "__main__":
    main()
