"""Timeline summaries: busy fraction as a union of device spans; export round trips."""

import json
import sys
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from minibatch.core.timeline import Timeline  # noqa: E402
from minibatch.serving.diagnostics import bursts, gc_pauses, window  # noqa: E402


def make():
    tl = Timeline()
    tl.add("CPU", "prepare", 0.0, 1.0, 0)
    tl.add("H2D", "H2D", 1.0, 1.5, 0)
    tl.add("compute", "compute", 1.2, 3.0, 0)  # overlaps the copy: counted once
    tl.add("D2H", "D2H", 3.0, 3.5, 0)
    tl.add("CPU", "update", 3.5, 4.0, 0)
    return tl


def test_busy_is_union_of_device_lanes():
    tl = make()
    assert tl.wall == 4.0
    assert abs(tl.busy() - 2.5) < 1e-12
    assert abs(tl.device_busy() - 2.5 / 4.0) < 1e-12
    assert tl.totals()["compute"] == 1.8


def test_save_load_and_chrome_trace(tmp_path):
    tl = make()
    tl.save(tmp_path / "t.json")
    again = Timeline.load(tmp_path / "t.json")
    assert [s.name for s in again.spans] == [s.name for s in tl.spans]
    tl.to_chrome_trace(tmp_path / "trace.json")
    events = json.load(open(tmp_path / "trace.json"))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 5 and spans[2]["dur"] == 1.8e6


def test_plot_draws(tmp_path):
    ax = make().plot()
    ax.figure.savefig(tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_sync_run_records_every_stage(random_llama):
    import minibatch
    tl = Timeline()
    minibatch.generate(random_llama, [[1, 2, 3], [4, 5]], max_new_tokens=4, timeline=tl)
    names = {s.name for s in tl.spans}
    assert names == {"prepare", "H2D", "compute", "D2H", "wait", "update"}
    assert 0 < tl.device_busy() <= 1
    steps = {s.step for s in tl.spans}
    assert steps == set(range(4))  # one prefill step (both prompts) + three decode steps


def test_plot_draws_every_lane(tmp_path):
    tl = make()
    tl.add("stream A", "work", 0.5, 1.5)
    ax = tl.plot()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["CPU", "H2D", "compute", "D2H", "stream A"]


def test_legend_lists_only_what_the_window_draws():
    tl = make()
    tl.add("H2D", "delay", 5.0, 6.0, 1)  # outside the window below
    ax = tl.plot(start=0.0, end=3.2)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["prepare", "H2D", "compute", "D2H"]
    ax = tl.plot()
    assert "delay" in [t.get_text() for t in ax.get_legend().get_texts()]
    tl.add("stream A", "a", 0.0, 1.0)
    tl.add("stream B", "b", 0.0, 1.0)  # no colour of their own: one grey entry for both
    assert [t.get_text() for t in tl.plot().get_legend().get_texts()][-1] == "a, b"


def test_step_labels_sit_on_wide_bars():
    tl = make()
    tl.add("compute", "compute", 3.6, 3.61, 1)  # too narrow to hold a label
    texts = [t.get_text() for t in tl.plot(step_labels=True).texts]
    assert texts.count("0") == 5 and "1" not in texts


def _serving_timeline() -> Timeline:
    """Two groups of requests 5 s apart, and a device span between them with no request (a load)."""
    tl = Timeline()
    tl.marks = [(0.0, "request 0"), (0.05, "request 1"), (5.0, "request 2")]
    for step in range(4):  # back to back from 0.01 to 0.21
        tl.add("compute", "compute", 0.01 + 0.05 * step, 0.06 + 0.05 * step, step)
    tl.add("H2D", "H2D", 3.0, 3.1)
    tl.add("compute", "compute", 5.0, 5.05, 4)
    tl.add("compute", "compute", 5.06, 5.1, 5)  # 10 ms idle before it
    return tl


def test_bursts_and_windows_of_a_serving_timeline():
    tl = _serving_timeline()
    busy = bursts(tl, quiet=0.5)
    assert busy == [pytest.approx((0.0, 0.21)), pytest.approx((5.0, 5.1))]  # the load is no burst
    w = window(tl, *busy[0])
    assert (w["arrivals"], w["steps"]) == (2, 4)
    assert w["arrival_spread_s"] == pytest.approx(0.05) and w["device_busy"] == pytest.approx(0.2 / 0.21)
    assert w["ms_per_step"] == pytest.approx(52.5) and w["compute_ms"] == pytest.approx(50)
    w = window(tl, *busy[1])
    assert (w["arrivals"], w["steps"], w["arrival_spread_s"]) == (1, 2, 0.0)
    assert w["device_busy"] == pytest.approx(0.09 / 0.1)
    assert bursts(tl, quiet=3.0) == [pytest.approx((0.0, 5.1))]  # a longer quiet joins everything


def test_timeline_bursts_script_prints_a_row_per_burst(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import timeline_bursts

    served, offline = tmp_path / "served.json", tmp_path / "offline.json"
    _serving_timeline().save(served)
    plain = Timeline()
    plain.add("compute", "compute", 1.0, 1.5, 0)
    plain.save(offline)
    timeline_bursts.main([str(served), str(offline)])
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:6] for line in out if line.strip()[:1].isdigit()] == [
        ["0.00", "0.21", "2", "50.0", "4", "95%"], ["5.00", "0.10", "1", "0.0", "2", "90%"],
        ["1.00", "0.50", "0", "0.0", "1", "100%"]]


def test_timeline_bursts_script_lists_the_longest_steps_of_each_burst_from_a_gzipped_file(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gzip
    import json

    import timeline_bursts

    tl = _serving_timeline()
    tl.add("compute", "compute", 0.215, 0.4, 6)  # one long step at the end of the first burst
    path = tmp_path / "served.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(tl.to_dict(), f)
    timeline_bursts.main([str(path), "--longest", "2"])
    listed = [line.split(": ", 1)[1] for line in capsys.readouterr().out.splitlines() if "longest" in line]
    # the first burst now runs to the long step's end (its four 50 ms steps tie, up to rounding)
    assert listed[0].startswith("step 6 185.0 ms, step ") and listed[0].endswith(" 50.0 ms")
    assert listed[1:] == ["step 4 50.0 ms, step 5 40.0 ms"]
    timeline_bursts.main([str(path), "--over", "45"])
    counts = [line.strip() for line in capsys.readouterr().out.splitlines() if "over 45 ms" in line]
    assert counts == ["compute spans over 45 ms: 5", "compute spans over 45 ms: 1", "whole file: 6 compute spans over 45 ms"]
    tl.save(tmp_path / "again.json.gz")  # save gzips a .gz name too
    with gzip.open(tmp_path / "again.json.gz", "rt") as f:
        assert json.load(f) == tl.to_dict()


def test_gc_pauses_records_full_collections_as_spans_a_window_counts():
    import gc

    tl, before = Timeline(), list(gc.callbacks)
    with gc_pauses(tl):
        gc.collect(0)  # a young generation: left out
        gc.collect()  # a full collection
    gc.collect()  # after the block: not recorded
    spans = [s for s in tl.spans if s.name == "gc"]
    assert len(spans) == 1 and spans[0].lane == "CPU" and spans[0].duration > 0
    assert gc.callbacks == before  # the callback is gone
    tl.mark("request 0", at=tl.t0 + spans[0].start - 0.01)
    tl.add("compute", "compute", spans[0].end + 0.2, spans[0].end + 0.3, 0)  # the step after the stall
    (start, end), = bursts(tl)  # a host stall keeps its burst going, which ends with the device
    assert end == pytest.approx(spans[0].end + 0.3)
    assert window(tl, start, end)["gc_s"] == pytest.approx(spans[0].duration)
    tl.add("CPU", "update", end, end + 0.05, 0)  # host work after the last step does not lengthen it
    assert bursts(tl) == [(start, end)]


def test_ttft_breakdown_says_how_long_a_first_token_was_held_after_its_step(tmp_path, capsys):
    """scripts/ttft_breakdown.py: queued, to first, its step, and "held": from the end of the admitting step's
    compute to the first token's delivery (the async loop's host launching the next step first)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import ttft_breakdown

    tl = Timeline()
    for rid, t0, step, held in (("a", 0.0, 1, 0.040), ("b", 5.0, 3, 0.001)):
        tl.mark(f"request {rid}", tl.t0 + t0)  # (marks take perf_counter seconds, spans the timeline's own)
        tl.add("CPU", "prepare", t0 + 0.005, t0 + 0.015, step)
        tl.mark(f"scheduled {rid}", tl.t0 + t0 + 0.010)
        tl.add("compute", "compute", t0 + 0.020, t0 + 0.060, step)
        tl.mark(f"first {rid}", tl.t0 + t0 + 0.060 + held)
    rows = sorted(ttft_breakdown.breakdown(tl), key=lambda r: r["arrival"])
    assert [r["held_ms"] for r in rows] == [pytest.approx(40.0), pytest.approx(1.0)]
    assert [(r["queued_ms"], r["step_ms"], r["steps"]) for r in rows] == [(pytest.approx(10.0), pytest.approx(40.0), 1)] * 2
    assert [len(g) for g in ttft_breakdown.bursts(rows, gap=2.0)] == [1, 1]
    assert [len(g) for g in ttft_breakdown.bursts(rows, gap=6.0)] == [2]
    path = tmp_path / "served.json"
    tl.save(path)
    ttft_breakdown.main([str(path), "--bursts"])
    out = capsys.readouterr().out
    assert out.count("burst ") == 2 and " 40.0 " in out
