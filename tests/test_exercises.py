"""Every exercise's check cell: passes with its solution, says "not attempted yet" for None, and fails
(AssertionError, with a hint) for plausible wrong answers, so no exercise can be passed without its idea."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

NB = Path(__file__).resolve().parents[1] / "notebooks"
sys.path.insert(0, str(NB))
import exercises  # noqa: E402


def solution(stem: str, name: str):
    spec = importlib.util.spec_from_file_location(f"solution_{stem}", NB / "solutions" / f"{stem}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


# --- plausible wrong answers, one idea missing in each ---

def count_without_eos(model, prompt, seed):  # generate never learns which token ends a text
    import minibatch
    return len(minibatch.generate(model, [prompt], max_new_tokens=200, temperature=0.7, seed=seed)[0])


def count_greedy(model, prompt, seed):  # ignores the sampling the exercise asks for
    import minibatch
    return len(minibatch.generate(model, [prompt], max_new_tokens=200, eos_token_id=model.tokenizer.eos_token_id)[0])


def count_without_the_eos_token(model, prompt, seed):
    return solution("00_welcome", "count_until_eos")(model, prompt, seed) - 1


def ragged_flat_positions(plan):  # positions counted in the flat batch, not in each request
    good = solution("01_synchronous_batching", "ragged_layout")(plan)
    return list(range(len(good[0]))), good[1]


def ragged_every_chunk_samples(plan):  # the last token of every chunk, sampling or not
    positions, ends, offset = [], [], 0
    for c in plan.chunks:
        positions += range(c.start, c.end)
        offset += c.end - c.start
        ends.append(offset - 1)
    return positions, ends


def ragged_chunk_end(plan):  # the request's position instead of the index in the flat batch
    positions = [p for c in plan.chunks for p in range(c.start, c.end)]
    return positions, [c.end - 1 for c in plan.chunks if c.sample]


def concurrency_touching_overlaps(tl):  # a span ending when another starts counts as overlapping
    points = sorted([(s.start, 0) for s in tl.spans] + [(s.end, 1) for s in tl.spans])
    running = best = 0
    for _, is_end in points:
        running += -1 if is_end else 1
        best = max(best, running)
    return best


def concurrency_lanes(tl):  # counts lanes, not spans running at once
    return len({s.lane for s in tl.spans})


def pipeline_without_events(dev, host_in, fn):
    h2d, compute, d2h = dev.stream("H2D"), dev.stream("compute"), dev.stream("D2H")
    dev_in, dev_out = dev.empty(host_in.shape, host_in.dtype), dev.empty(host_in.shape, host_in.dtype)
    host_out = dev.pin(torch.zeros_like(host_in))
    h2d.copy(dev_in, host_in)
    compute.launch(fn, dev_in, dev_out)
    d2h.copy(host_out, dev_out)
    d2h.synchronize(timeout=10)
    return host_out.tolist()


def pipeline_waiting_for_everything(dev, host_in, fn):
    h2d, compute, d2h = dev.stream("H2D"), dev.stream("compute"), dev.stream("D2H")
    done = [dev.event(), dev.event()]
    dev_in, dev_out = dev.empty(host_in.shape, host_in.dtype), dev.empty(host_in.shape, host_in.dtype)
    host_out = dev.pin(torch.zeros_like(host_in))
    h2d.copy(dev_in, host_in)
    h2d.record(done[0])
    compute.wait(done[0])
    compute.launch(fn, dev_in, dev_out)
    compute.record(done[1])
    d2h.wait(done[1])
    d2h.copy(host_out, dev_out)
    dev.synchronize(timeout=10)  # right values, but waits for the unrelated stream too
    return host_out.tolist()


def pipeline_host_waits_each_stream(dev, host_in, fn):  # right values, no events: the host orders the streams
    h2d, compute, d2h = dev.stream("H2D"), dev.stream("compute"), dev.stream("D2H")
    dev_in, dev_out = dev.empty(host_in.shape, host_in.dtype), dev.empty(host_in.shape, host_in.dtype)
    host_out = dev.pin(torch.zeros_like(host_in))
    h2d.copy(dev_in, host_in)
    h2d.synchronize(timeout=10)
    compute.launch(fn, dev_in, dev_out)
    compute.synchronize(timeout=10)
    d2h.copy(host_out, dev_out)
    d2h.synchronize(timeout=10)
    return host_out.tolist()


def pipeline_events_and_extra_waits(dev, host_in, fn):  # events, but the host also waits on each event
    h2d, compute, d2h = dev.stream("H2D"), dev.stream("compute"), dev.stream("D2H")
    done = [dev.event(), dev.event(), dev.event()]
    dev_in, dev_out = dev.empty(host_in.shape, host_in.dtype), dev.empty(host_in.shape, host_in.dtype)
    host_out = dev.pin(torch.zeros_like(host_in))
    h2d.copy(dev_in, host_in)
    h2d.record(done[0])
    compute.wait(done[0])
    done[0].synchronize(timeout=10)
    compute.launch(fn, dev_in, dev_out)
    compute.record(done[1])
    d2h.wait(done[1])
    done[1].synchronize(timeout=10)
    d2h.copy(host_out, dev_out)
    d2h.record(done[2])
    done[2].synchronize(timeout=10)
    return host_out.tolist()


def graphs_one_per_shape(steps, kv_bucket):  # forgets that each slot needs its own graphs
    from minibatch.core.buckets import bucket
    from minibatch.core.buckets import ROW_BUCKETS
    return len({(bucket(r, ROW_BUCKETS), -(-(c + 1) // kv_bucket) * kv_bucket) for r, c in steps})


def graphs_without_the_new_token(steps, kv_bucket):
    from minibatch.core.buckets import bucket
    from minibatch.core.buckets import ROW_BUCKETS
    return len({(n % 2, bucket(r, ROW_BUCKETS), -(-c // kv_bucket) * kv_bucket) for n, (r, c) in enumerate(steps)})


def graphs_per_step(steps, kv_bucket):  # a capture every step
    return len(steps)


def scatter_in_place(input_ids, prev_output, mask):
    keep = mask >= 0
    input_ids[mask[keep]] = prev_output[: mask.shape[0]][keep]
    return input_ids


def scatter_with_host_loop(input_ids, prev_output, mask):
    out = input_ids.clone()
    for i, m in enumerate(mask.tolist()):
        if m >= 0:
            out[m] = prev_output[i]
    return out


def scatter_all_rows(input_ids, prev_output, mask):  # -1 rows land on the last position
    return input_ids.clone().index_put_((mask,), prev_output[: mask.shape[0]])


def gaps_unsorted(tl):  # takes the spans in the order they were added
    spans = [s for s in tl.spans if s.name == "compute"]
    return [max(0.0, b.start - a.end) for a, b in zip(spans, spans[1:])]


def gaps_every_span(tl):  # any span on the compute lane, a delay included
    spans = sorted((s for s in tl.spans if s.lane == "compute"), key=lambda s: (s.step, s.start))
    return [max(0.0, b.start - a.end) for a, b in zip(spans, spans[1:])]


def gaps_negative(tl):
    spans = sorted((s for s in tl.spans if s.name == "compute"), key=lambda s: s.step)
    return [b.start - a.end for a, b in zip(spans, spans[1:])]


def ratio_same_step(host, device):  # overlaps a step's host time with its own device time
    return sum(max(h, d) for h, d in zip(host, device)) / (sum(host) + sum(device))


def ratio_device_only(host, device):  # as if all host time were hidden
    return sum(device) / (sum(host) + sum(device))


def ratio_inverted(host, device):
    return 1 / solution("07_does_it_work", "async_over_sync")(host, device)


def latencies_to_last(arrival, times):  # TTFT measured to the last token
    return times[-1] - arrival, [b - a for a, b in zip(times, times[1:])]


def latencies_gap_from_arrival(arrival, times):  # the wait before the first token counted as a gap
    return times[0] - arrival, [b - a for a, b in zip([arrival] + times, times)]


def latencies_from_zero(arrival, times):  # TTFT as the first token's clock time
    return times[0], [b - a for a, b in zip(times, times[1:])]


CASES = [  # (check, solution module, name, wrong answers)
    ("check_00", "00_welcome", "count_until_eos",
     [lambda model, prompt, seed: 200, count_without_eos, count_greedy, count_without_the_eos_token]),
    ("check_01", "01_synchronous_batching", "ragged_layout",
     [ragged_flat_positions, ragged_every_chunk_samples, ragged_chunk_end]),
    ("check_02", "02_cuda_streams", "max_concurrency", [concurrency_touching_overlaps, concurrency_lanes]),
    ("check_03", "03_cuda_events", "pipeline", [pipeline_without_events, pipeline_waiting_for_everything,
                                                      pipeline_host_waits_each_stream, pipeline_events_and_extra_waits]),
    ("check_04", "04_race_conditions_and_slots", "count_graphs",
     [graphs_one_per_shape, graphs_without_the_new_token, graphs_per_step]),
    ("check_05", "05_carry_over", "scatter_carry_over", [scatter_in_place, scatter_with_host_loop, scatter_all_rows]),
    ("check_06", "06_the_full_async_loop", "compute_gaps", [gaps_unsorted, gaps_every_span, gaps_negative]),
    ("check_07", "07_does_it_work", "async_over_sync", [ratio_same_step, ratio_device_only, ratio_inverted]),
    ("check_08", "08_serving", "latencies", [latencies_to_last, latencies_gap_from_arrival, latencies_from_zero]),
]


@pytest.mark.parametrize("check, stem, name, wrong", CASES, ids=[c[0] for c in CASES])
def test_check(check, stem, name, wrong, capsys):
    getattr(exercises, check)(None)
    assert "not attempted yet" in capsys.readouterr().out
    getattr(exercises, check)(solution(stem, name))
    assert "✓ correct" in capsys.readouterr().out
    for answer in wrong:
        with pytest.raises(AssertionError):
            getattr(exercises, check)(answer)


def test_every_notebook_check_cell_survives_a_fresh_kernel():
    """The check cells pass globals().get(name): run before the exercise cell, they say "not attempted yet"."""
    for src in sorted((NB / "src").glob("[0-9][0-9]_*.py")):
        text = src.read_text()
        assert f'exercises.check_{src.stem[:2]}(globals().get("' in text, src.name


@pytest.mark.parametrize("wrong, hint", [(pipeline_host_waits_each_stream, "not through events"),
                                         (pipeline_events_and_extra_waits, "waited 3 times")])
def test_check_03_names_the_missing_idea(wrong, hint):
    with pytest.raises(AssertionError, match=hint):
        exercises.check_03(wrong)
