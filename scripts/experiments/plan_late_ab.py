"""Does planning the async loop's next step late bring a new request into an earlier step?

    python scripts/experiments/plan_late_ab.py OUT [--model tiny] [--rates 8,32] [--rounds 2] [--lead-ms 1]

The async loop plans step N+2 right after it has updated with step N, while N+1 runs: a request that
arrives during N+1 misses N+2 and waits for N+3, one step more than in the sync loop, which plans
after the step in flight is over (BENCHMARKS.md, "Serving latency ..."). Here the serving loop
instead sleeps before it plans, until a request arrives or until the step in flight is about
`--lead-ms` from its end, so that what arrives meanwhile joins the next step. How long to sleep is
learnt from the loop itself: the host's wait for the step in flight after launching the next one
is the slack; the sleep grows while the slack is above the lead and shrinks fast when it is not (a
slack of zero means the device may have idled). A turn that launches an eager step on a GPU
(launch-bound: the async loop updates first there) resets the sleep to zero.

This is the serving loop patched in this process, async against async-late, alternating `--rounds`
times, each at every rate (tools/online.compare's workload: random prompts, no EOS, a warm-up pass
first). Writes OUT/plan_late.json and prints TTFT and ITL side by side. Only timing changes: which
step a request joins never changes its tokens (tests/test_online.py checks that for any arrivals).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import minibatch  # noqa: E402
from minibatch.core import async_loop  # noqa: E402
from minibatch.serving.loop import ServingLoop  # noqa: E402
from minibatch.tools.online import compare  # noqa: E402


SLEEPS: list[float] = []  # the sleep each turn of the late loop chose (seconds), for the summary


def patch(lead_s: float):
    """Late planning, patched into ServingLoop.turn and async_loop._update; returns a function that undoes it."""
    plain_turn, plain_update = ServingLoop.turn, async_loop._update

    def update(run, in_flight):  # the host's wait for batch N (its slack) and the update, timed
        started = time.perf_counter()
        done = plain_update(run, in_flight)
        run.late_update_s = time.perf_counter() - started
        return done

    def turn(self):
        state = self.__dict__.setdefault("late", {"sleep": 0.0, "returned": None})
        SLEEPS.append(state["sleep"])
        self._take_arrivals()
        run = self.run
        if run.scheduler.has_work() and run.in_flight is not None and state["returned"] is not None:
            deadline = state["returned"] + state["sleep"]
            with self.cond:
                self.cond.wait_for(lambda: self.inbox or self.cancels or self.closing,
                                   timeout=max(0.0, deadline - time.perf_counter()))
            self._take_arrivals()
        launched_before = run.launched
        run.late_update_s = None
        n = plain_turn(self)  # (takes arrivals again: none new)
        state["returned"] = time.perf_counter() if run.in_flight is not None else None
        slack = run.late_update_s
        if slack is None or run.launched == launched_before:
            state["sleep"] = 0.0
        elif slack > 2 * lead_s:
            state["sleep"] += 0.5 * (slack - 2 * lead_s)  # grow slowly
        else:
            state["sleep"] *= 0.5  # shrink fast: the device may have idled
        state["sleep"] = min(state["sleep"], 0.05)
        return n

    ServingLoop.turn, async_loop._update = turn, update
    return lambda: (setattr(ServingLoop, "turn", plain_turn), setattr(async_loop, "_update", plain_update))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="auto")
    p.add_argument("--rates", default="8,32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--lead-ms", type=float, default=1.0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = minibatch.load_model(args.model, device=args.device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.num_prompts)]
    rates = [float(r) for r in args.rates.split(",")]
    kw = dict(max_batch_size=args.max_batch_size, max_batch_tokens=max(args.max_batch_size, 256))
    rows = []
    for k in range(args.rounds):
        for label in ("async", "async-late"):
            undo = patch(args.lead_ms / 1e3) if label == "async-late" else None
            try:
                for r in compare(model, prompts, rates, args.max_new_tokens, modes=("async",), **kw):
                    rows.append({**r, "label": label, "round": k})
            finally:
                if undo is not None:
                    undo()
    sleeps = sorted(SLEEPS)
    summary = {"turns": len(sleeps), "sleep_ms_p50": 1e3 * sleeps[len(sleeps) // 2] if sleeps else None,
               "sleep_ms_p90": 1e3 * sleeps[int(0.9 * len(sleeps))] if sleeps else None}
    (out / "plan_late.json").write_text(json.dumps({"args": vars(args), "rows": rows, "late_sleep": summary},
                                                   indent=1, default=str))
    print(f"late loop: {summary['turns']} turns, sleep before planning p50 {summary['sleep_ms_p50']:.2f} ms, "
          f"p90 {summary['sleep_ms_p90']:.2f} ms")
    print(f"{'round':>5} {'rate':>6} {'label':>11} {'TTFT p50':>9} {'TTFT p90':>9} {'ITL p50':>8} {'ITL p99':>8} {'tok/s':>7}")
    for r in rows:
        print(f"{r['round']:5d} {r['rate']:6.0f} {r['label']:>11} {r['ttft_p50_ms']:9.2f} {r['ttft_p90_ms']:9.2f} "
              f"{r['itl_p50_ms']:8.2f} {r['itl_p99_ms']:8.2f} {r['tok_per_s']:7.0f}")


if __name__ == "__main__":
    main()
