"""Timeline summaries: busy fraction as a union of device spans; export round trips."""

import json

import matplotlib

matplotlib.use("Agg")

from minibatch.timeline import Timeline  # noqa: E402


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
