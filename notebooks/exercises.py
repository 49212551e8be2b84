"""Check cells for the notebooks' exercises (the solutions are in notebooks/solutions/).

Each `check_*` takes what the student wrote. If it is still None (the check cells pass
`globals().get(name)`, so a check run before the exercise cell gives None too), it says so and
returns; otherwise it tests the answer and prints ✓ or raises AssertionError with a hint.
tests/test_exercises.py runs every check with its solution and with wrong answers.
"""

from __future__ import annotations

import functools


def _not_yet(answer, name: str) -> bool:
    if answer is None:
        print(f"not attempted yet: write `{name}` in the cell above, run it, then run this cell again")
        return True
    return False


@functools.cache
def _tiny():
    import minibatch
    return minibatch.load_model("tiny", device="cpu")


@functools.cache
def _tokens_until_eos(prompt: str, seed: int) -> int:
    import minibatch
    model = _tiny()
    eos = model.tokenizer.eos_token_id
    out = minibatch.generate(model, [prompt], max_new_tokens=200, temperature=0.7, seed=seed, eos_token_id=eos)[0]
    assert out[-1] == eos and len(out) < 200, "the tiny model changed: pick prompts that reach EOS again"
    return len(out)


def check_00(count_until_eos) -> None:
    """count_until_eos(model, prompt, seed) -> new tokens until (and including) EOS, sampling as in the notebook."""
    if _not_yet(count_until_eos, "count_until_eos"):
        return
    model = _tiny()
    # prompts and seeds for which the model stops by itself well before the 200-token cap
    for prompt, seed in (("Exceptions are raised", 5), ("The import system", 1), ("Names refer to objects", 2)):
        made = _tokens_until_eos(prompt, seed)
        got = count_until_eos(model, prompt, seed)
        assert got == made, (f"{prompt!r}, seed {seed}: you counted {got}, the model made {made} tokens "
                                 "(EOS included). Sample as the notebook does (temperature 0.7, that seed) and tell "
                                 "generate which token ends a text, or it never stops before max_new_tokens")
    print("✓ correct")


def check_01(ragged_layout) -> None:
    """ragged_layout(plan) -> (positions, logits_indices) of the flat batch, as lists."""
    if _not_yet(ragged_layout, "ragged_layout"):
        return
    from minibatch.core.batch import build_batch
    from minibatch.core.requests import Request, SamplingParams
    from minibatch.core.scheduler import Scheduler

    cache = _tiny().make_cache(num_blocks=32, block_size=4)
    sched = Scheduler(cache.allocator, max_batch_tokens=8, max_batch_size=3)
    for i, n in enumerate([10, 3, 7, 5]):
        sched.add(Request(i, [1] * n, SamplingParams(max_new_tokens=4)))
    while sched.has_work():  # mixed steps: chunked prefills, last chunks that sample, decode tokens
        plan = sched.schedule()
        host = build_batch(plan, cache)
        want = (host.positions.tolist(), host.logits_indices.tolist())
        got = ragged_layout(plan)
        got = tuple(list(x.tolist() if hasattr(x, "tolist") else x) for x in got)
        chunks = "  ".join(f"r{c.request.rid}[{c.start}:{c.end}]{'→sample' if c.sample else ''}" for c in plan.chunks)
        assert got[0] == want[0], (f"step {plan.step} ({chunks}): positions {got[0]}, expected {want[0]} (a token's "
                                   "position is its index in its own request, not in the flat batch)")
        assert got[1] == want[1], (f"step {plan.step} ({chunks}): logits_indices {got[1]}, expected {want[1]} (the "
                                   "last token of each chunk that samples, counted in the flat batch)")
        sched.update(plan, [2] * len(plan.sampling_chunks))
    print("✓ correct")


def _device_ops(fn, *args) -> list[str]:
    """The aten ops fn runs on these tensors; '[bool]' marks indexing with a boolean mask."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x])]
            masked = "index" in func.__name__ and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool
                                                      for a in flat[1:])
            ops.append(func.__name__ + ("[bool]" if masked else ""))
            return func(*args, **(kwargs or {}))

    with Record():
        fn(*args)
    return ops


def check_05(scatter_carry_over) -> None:
    """scatter_carry_over(input_ids, prev_output, mask) -> new ids with the carried tokens written in."""
    if _not_yet(scatter_carry_over, "scatter_carry_over"):
        return
    import torch

    from minibatch.core.carry_over import apply_carry_over

    g = torch.Generator().manual_seed(5)
    cases = [([0, 5, 6, 0], [17, 42, 99], [3, -1, 0]), ([0], [7], [0]), ([1, 2, 3], [9, 9], [-1, -1]),
             ([0, 0, 4], [11, 12, 13, 14], [1, 0])]  # the last: prev_output longer than the mask
    for _ in range(20):
        t, r = int(torch.randint(1, 12, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
        dest = torch.randperm(t + r, generator=g)[:r]
        mask = torch.where(dest < t, dest, -1)
        ids = torch.randint(1, 256, (t,), generator=g)
        ids[mask[mask >= 0]] = 0
        cases.append((ids.tolist(), torch.randint(0, 260, (r,), generator=g).tolist(), mask.tolist()))
    for ids, out, mask in cases:
        ids_t, out_t, mask_t = torch.tensor(ids), torch.tensor(out), torch.tensor(mask)
        want = torch.empty_like(ids_t)
        apply_carry_over(want, ids_t, out_t, mask_t)
        got = scatter_carry_over(ids_t, out_t, mask_t)
        assert isinstance(got, torch.Tensor), f"return a tensor, got {type(got).__name__}"
        assert ids_t.tolist() == ids, "return a new tensor: do not modify input_ids in place"
        assert got.shape == ids_t.shape, f"the result must have batch N+1's length {len(ids)}, got {tuple(got.shape)}"
        assert got.tolist() == want.tolist(), (f"input_ids={ids}, prev_output={out}, mask={mask}: expected "
                                               f"{want.tolist()}, got {got.tolist()} (rows with mask -1 go nowhere; "
                                               "only the first len(mask) rows of prev_output count)")
    # device-friendly: the same ops whatever the data, no host sync, no data-dependent shapes
    runs = [_device_ops(scatter_carry_over, torch.tensor(i), torch.tensor([5, 6, 8, 9]), torch.tensor(m))
            for i, m in (([0, 0, 7, 0], [0, 1, 3, -1]), ([1, 2, 7, 3], [-1, -1, -1, -1]))]
    ops = set(runs[0] + runs[1])
    assert not any(o.startswith("_local_scalar_dense") for o in ops), ("correct values, but your function reads tensor values on the host "
                                              "(.item(), int(t), `if t >= 0`): on a GPU each is a synchronization")
    assert not any(o.endswith("[bool]") or o.startswith(("nonzero", "masked_select")) for o in ops), (
        "correct values, but boolean indexing (or nonzero / masked_select) gives a tensor whose size depends on "
        "the data: on a GPU that is a hidden synchronization, and a CUDA graph cannot hold it")
    assert runs[0] == runs[1], ("correct values, but your function runs different device ops for different masks "
                                "(a Python loop or branch over the rows?): a CUDA graph needs the same ops every step")
    print("✓ correct")


def check_06(compute_gaps) -> None:
    """compute_gaps(tl) -> for each step N >= 1, idle seconds between compute N-1's end and compute N's start."""
    if _not_yet(compute_gaps, "compute_gaps"):
        return
    from minibatch.core.timeline import Timeline

    tl = Timeline()
    # steps 0..4 on the compute lane, added out of order, with other lanes and names around them
    for lane, name, start, end, step in [
            ("compute", "compute", 0.30, 0.40, 2), ("CPU", "prepare", 0.00, 0.05, 0),
            ("compute", "compute", 0.10, 0.20, 0), ("H2D", "H2D", 0.05, 0.06, 0),
            ("compute", "delay", 0.20, 0.25, 1), ("compute", "compute", 0.25, 0.30, 1),
            ("compute", "compute", 0.38, 0.50, 3), ("CPU", "wait", 0.20, 0.60, 3),
            ("compute", "compute", 0.65, 0.70, 4), ("D2H", "D2H", 0.50, 0.51, 3)]:
        tl.add(lane, name, start, end, step)
    expected = [0.05, 0.0, 0.0, 0.15]
    got = compute_gaps(tl)
    assert len(got) == len(expected), (f"expected {len(expected)} gaps (one per step from step 1 on), got {len(got)}; "
                                       "use only spans named 'compute'")
    for n, (g, e) in enumerate(zip(got, expected), start=1):
        assert abs(g - e) < 1e-9, (f"step {n}: expected a gap of {e:.2f} s, got {g:.2f} s (sort the compute spans by "
                                   "step; a gap is never negative)")
    print("✓ correct")


def check_04(count_graphs) -> None:
    """count_graphs(steps, kv_bucket) -> how many CUDA graphs decode steps (rows, longest_context) capture."""
    if _not_yet(count_graphs, "count_graphs"):
        return
    from minibatch.core.buckets import bucket
    from minibatch.core.buckets import ROW_BUCKETS

    def want(steps, kb):
        return len({(n % 2, bucket(rows, ROW_BUCKETS), -(-(ctx + 1) // kb) * kb) for n, (rows, ctx) in enumerate(steps)})

    cases = [([(13, 700)], 64),
             ([(13, 700), (13, 701)], 64),  # same shape, but the second step runs from the other slot
             ([(13, 700), (13, 701), (13, 702)], 64),  # slot A again, same bucket: replayed, not captured
             ([(5, 62), (5, 63), (6, 63), (5, 64)], 64),  # 63 + 1 keys fit in 64; 64 + 1 do not
             ([(3, 10), (4, 10), (3, 10), (4, 10)], 256),  # 3 and 4 rows share a row bucket
             ([(30, 100)] * 2 + [(20, 100)] * 2 + [(9, 300)] * 4, 128)]
    for steps, kb in cases:
        got = count_graphs(list(steps), kb)
        assert got == want(steps, kb), (f"count_graphs({steps}, {kb}) = {got}, expected {want(steps, kb)}: a graph "
                                        "is captured once per (slot, padded rows, padded keys); steps alternate "
                                        "slots A, B, A, ...; a row holds its context plus the new token")
    print("✓ correct")


def check_02(max_concurrency) -> None:
    """max_concurrency(tl) -> the largest number of spans of a Timeline running at the same moment."""
    if _not_yet(max_concurrency, "max_concurrency"):
        return
    from minibatch.devices import get_device
    from minibatch.core.timeline import Timeline

    cases = [  # (spans as (lane, start, end), expected); not sorted on purpose
        ([("A", 0.0, 1.0)], 1),
        ([("B", 0.5, 1.5), ("A", 0.0, 1.0)], 2),
        ([("A", 0.0, 1.0), ("B", 1.0, 2.0)], 1),  # they only touch
        ([("A", 1.0, 2.0), ("A", 0.0, 1.0), ("B", 2.0, 3.0)], 1),
        ([("D", 2.0, 4.0), ("A", 0.0, 3.0), ("C", 1.5, 2.5), ("B", 1.0, 2.0)], 3),
        ([("A", 0.0, 10.0), ("B", 1.0, 2.0), ("C", 3.0, 4.0), ("D", 5.0, 6.0)], 2),
        ([("A", 0.0, 1.0), ("B", 0.0, 1.0), ("C", 0.0, 1.0), ("D", 1.0, 2.0)], 3),
    ]
    for spans, want in cases:
        tl = Timeline()
        for i, (lane, start, end) in enumerate(spans):
            tl.add(lane, f"k{i}", start, end)
        got = max_concurrency(tl)
        assert got == want, (f"spans {[(lane, a, b) for lane, a, b in spans]}: expected {want}, got {got} "
                             "(spans are not sorted; a span ending exactly when another starts does not overlap it)")
    for with_default, want in ((False, 2), (True, 1)):  # recorded on the emulated device, as in the notebook
        tl = Timeline()
        with get_device("cpu", tl) as dev:
            dev.stream("A").sleep(0.05, name="a", lane="stream A")
            if with_default:
                dev.default_stream.sleep(0.01, name="small op", lane="default")
            dev.stream("B").sleep(0.05, name="b", lane="stream B")
            dev.synchronize(timeout=10)
        got = max_concurrency(tl)
        assert got == want, (f"two streams{' with a small op on the default stream between them' if with_default else ''}: "
                             f"expected {want}, got {got}")
    print("✓ correct")


class _Counted:
    """A device, stream or event that passes every call through and counts host waits and stream waits."""

    def __init__(self, real, counts):
        self._real, self._counts = real, counts

    def __getattr__(self, name):
        return getattr(self._real, name)

    def stream(self, *args, **kwargs):
        return _Counted(self._real.stream(*args, **kwargs), self._counts)

    def event(self, *args, **kwargs):
        return _Counted(self._real.event(*args, **kwargs), self._counts)

    def record(self, event, *args, **kwargs):
        return self._real.record(getattr(event, "_real", event), *args, **kwargs)

    def wait(self, event, *args, **kwargs):
        self._counts["stream waits"] += 1
        return self._real.wait(getattr(event, "_real", event), *args, **kwargs)

    def synchronize(self, *args, **kwargs):
        self._counts["host waits"] += 1
        return self._real.synchronize(*args, **kwargs)


def _check_03_waits(counts) -> None:
    assert counts["stream waits"] >= 2, (
        "right result, but not through events: compute and D2H must each wait for an event (stream.wait(event)) "
        "recorded on the stream before them, so the streams order themselves without the host")
    assert counts["host waits"] == 1, (
        f"right result, but the host waited {counts['host waits']} times: with events chaining the streams, the "
        "host needs one wait only, d2h_done.synchronize(), after the D2H copy")


def check_03(pipeline) -> None:
    """pipeline(dev, host_in, fn) -> fn applied on the device to host_in, through H2D, compute and D2H, as a list."""
    if _not_yet(pipeline, "pipeline"):
        return
    import time

    import torch

    from minibatch.devices import get_device

    def fn(x, out):
        torch.add(x * x, 1, out=out)

    host_in = torch.arange(1, 9)
    want = (host_in * host_in + 1).tolist()
    chain = ("The chain: H2D copies, records h2d_done; compute waits for h2d_done, runs fn, records compute_done; "
             "D2H waits for compute_done, copies, records d2h_done; the host synchronizes on d2h_done, then reads.")
    culprit = {"H2D": "did compute wait for an event recorded after the H2D copy?",
               "compute": "did D2H wait for an event recorded after fn?",
               "D2H": "did the host synchronize on an event recorded after the D2H copy before reading?"}
    for busy in ("H2D", "compute", "D2H", None):
        with get_device("cpu") as dev:
            if busy is not None:
                dev.stream(busy).sleep(0.2)  # that stream is still busy with earlier work
            dev.stream("other").sleep(1.0)  # unrelated work on another stream
            start, counts = time.perf_counter(), {"stream waits": 0, "host waits": 0}
            got = pipeline(_Counted(dev, counts), dev.pin(host_in), fn)
            took = time.perf_counter() - start
            got = got.tolist() if isinstance(got, torch.Tensor) else list(got)
        where = f"with the {busy} stream busy for 0.2 s" if busy else "with idle streams"
        hint = f"First suspect: {culprit[busy]} " if busy else ""
        assert got == want, f"{where}: expected {want}, got {got}. Something ran before its input was ready. {hint}{chain}"
        assert took < 0.8, (f"right result, but the host waited {took:.1f} s: it waited for unrelated work on another "
                            "stream. Synchronize on the event after your D2H copy, not on the whole device, and "
                            "keep off dev.default_stream")
        _check_03_waits(counts)
    print("✓ correct")


def check_07(async_over_sync) -> None:
    """async_over_sync(host, device) -> predicted wall-time ratio of the async loop over the sync loop."""
    if _not_yet(async_over_sync, "async_over_sync"):
        return

    def want(h, d):
        sync = sum(h) + sum(d)
        nxt = list(h[1:]) + [0.0]
        return (h[0] + sum(max(dn, hn) for dn, hn in zip(d, nxt))) / sync

    cases = [([1.0, 1.0, 1.0], [4.0, 4.0, 4.0]),  # device-bound: the host hides behind it
             ([4.0, 4.0, 4.0], [1.0, 1.0, 1.0]),  # host-bound: the device waits for the host
             ([2.0], [3.0]),  # one step: nothing to overlap
             ([1.0, 5.0, 1.0, 5.0], [3.0, 3.0, 3.0, 3.0]),  # step N's device time hides step N+1's host time
             ([0.5, 0.5, 3.0, 0.5], [2.0, 1.0, 2.0, 2.0])]
    for h, d in cases:
        got = async_over_sync(list(h), list(d))
        assert abs(got - want(h, d)) < 1e-9, (
            f"async_over_sync({h}, {d}) = {got:.4f}, expected {want(h, d):.4f}: the sync loop pays host + device "
            "every step; the async loop prepares step n+1 on the host while the device runs step n")
    print("✓ correct")


def check_08(latencies) -> None:
    """latencies(arrival, token_times) -> (ttft, itl): seconds to the first token, gaps between tokens."""
    if _not_yet(latencies, "latencies"):
        return
    cases = [(10.0, [10.5, 10.6, 10.85, 11.0], 0.5, [0.1, 0.25, 0.15]),
             (2.0, [2.25], 0.25, []),
             (0.0, [0.3, 0.3, 0.9], 0.3, [0.0, 0.6])]
    for arrival, times, ttft, itl in cases:
        got = latencies(arrival, list(times))
        assert isinstance(got, tuple) and len(got) == 2, "return a pair (ttft, itl)"
        got_ttft, got_itl = got
        assert abs(got_ttft - ttft) < 1e-9, (f"arrival {arrival}, tokens at {times}: TTFT should be {ttft} s, got "
                                            f"{got_ttft} (from the arrival to the first token, not to the last)")
        got_itl = list(got_itl)
        assert len(got_itl) == len(itl), (f"{len(times)} tokens have {len(itl)} gaps between them, got {len(got_itl)} "
                                          "(the wait before the first token is TTFT, not a gap between tokens)")
        assert all(abs(g - e) < 1e-9 for g, e in zip(got_itl, itl)), f"gaps should be {itl}, got {got_itl}"
    print("✓ correct")
