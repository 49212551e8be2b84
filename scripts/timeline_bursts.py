"""Where a serving run's time went, burst by burst, from a timeline file.

    python scripts/timeline_bursts.py TIMELINE.json [TIMELINE.json.gz ...] [--quiet 0.5] [--longest N] [--over MS]

TIMELINE.json: what `python -m minibatch serve --timeline FILE` writes as the server stops, or a
`bench --out` timeline (an offline run: one window over the whole file). A burst runs from the first
arrival of a group of requests to the end of the last device span after it; a gap of `--quiet`
seconds with nothing recorded ends it (serving/diagnostics.py). Per burst: the requests that arrived and
over how long, the steps, the device's busy share, the wall time per step, and the milliseconds of
full garbage collections where the timeline recorded them (`serve --timeline` does). Set a
rate-inf burst of the server beside the offline run of the same workload: more steps, longer steps
or an idle device each point at a different cause. `--longest N` lists each burst's N longest
compute spans (step number, start, milliseconds): where a burst's time per step is high, whether a
few steps or all of them are to blame. `--over MS` counts, per burst and in the whole file, the compute
spans longer than MS milliseconds: set the whole-file count beside the server's `graph_captures` (its
stop line) to see whether the longest steps are the CUDA graph captures (a capture's compute span holds
the warm-up run, the capture and the replay).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minibatch.core.timeline import Timeline  # noqa: E402
from minibatch.serving.diagnostics import bursts, window  # noqa: E402


def rows(timeline: Timeline, quiet: float) -> list[dict]:
    """One summary per burst (diagnostics.window), or one over the whole timeline if it has no arrivals."""
    if timeline.arrivals():
        return [{"start_s": a, **window(timeline, a, b)} for a, b in bursts(timeline, quiet)]
    if not timeline.spans:
        return []
    a, b = min(s.start for s in timeline.spans), max(s.end for s in timeline.spans)
    return [{"start_s": a, **window(timeline, a, b)}]


def longest(timeline: Timeline, start: float, end: float, n: int) -> list[tuple[int, float, float]]:
    """The n longest compute spans that start in [start, end): (step, start s, ms), longest first."""
    spans = [s for s in timeline.spans if s.lane == "compute" and start <= s.start < end]
    spans.sort(key=lambda s: s.duration, reverse=True)
    return [(s.step, s.start, 1000 * s.duration) for s in spans[:n]]


def over(timeline: Timeline, start: float, end: float, ms: float) -> int:
    """How many compute spans that start in [start, end) last longer than `ms` milliseconds."""
    return sum(1 for s in timeline.spans if s.lane == "compute" and start <= s.start < end and s.duration * 1000 > ms)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--quiet", type=float, default=0.5, help="seconds of nothing that end a burst")
    p.add_argument("--longest", type=int, default=0, metavar="N", help="list each burst's N longest compute spans")
    p.add_argument("--over", type=float, default=None, metavar="MS",
                   help="count the compute spans longer than MS milliseconds, per burst and in the whole file")
    args = p.parse_args(argv)
    for f in args.files:
        print(f)
        print(f"{'start s':>9} {'wall s':>7} {'arrived':>7} {'over ms':>8} {'steps':>6} {'busy':>5} "
              f"{'ms/step':>8} {'compute ms':>10} {'gc ms':>6}")
        timeline = Timeline.load(f)
        for r in rows(timeline, args.quiet):
            print(f"{r['start_s']:9.2f} {r['wall_s']:7.2f} {r['arrivals']:7d} {1000 * r['arrival_spread_s']:8.1f} "
                  f"{r['steps']:6d} {r['device_busy']:5.0%} {r['ms_per_step']:8.2f} {r['compute_ms']:10.2f} "
                  f"{1000 * r['gc_s']:6.0f}")
            if args.longest:
                top = longest(timeline, r["start_s"], r["start_s"] + r["wall_s"], args.longest)
                print("          longest compute: " + ", ".join(f"step {k} {ms:.1f} ms" for k, _, ms in top))
            if args.over is not None:
                print(f"          compute spans over {args.over:g} ms: "
                      f"{over(timeline, r['start_s'], r['start_s'] + r['wall_s'], args.over)}")
        if args.over is not None:
            print(f"whole file: {over(timeline, float('-inf'), float('inf'), args.over)} compute spans over {args.over:g} ms")


if __name__ == "__main__":
    main()
