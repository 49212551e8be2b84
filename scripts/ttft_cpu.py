"""Time to first token, async / sync, on the CPU: notebook 07 section 6's measurement, repeated.

    python scripts/ttft_cpu.py --runs 5

Prints, for each run, the mean time to first token of the async loop over the sync loop's (twelve
requests arriving every third step, tiny model). The steps at which first tokens arrive are the
same in both loops; the seconds depend on the machine and on what else runs on it, hence the runs.
"""

import argparse
import time

import minibatch


def first_token_seconds(model, prompts, mode: str) -> list[float]:
    first, t0 = {}, time.perf_counter()

    def on_step(plan, done):
        for c in plan.sampling_chunks:
            first.setdefault(c.request.rid, time.perf_counter() - t0)

    minibatch.generate(model, prompts, mode=mode, max_new_tokens=24, max_batch_size=4, max_batch_tokens=32,
                       arrival_steps=[3 * i for i in range(len(prompts))], on_step=on_step)
    return [first[i] for i in range(len(prompts))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    model = minibatch.load_model("tiny", device="cpu")
    texts = ["The for statement", "A class definition", "Exceptions are raised", "The import system",
             "Assignment statements", "A string literal"] * 2
    prompts = [model.tokenizer.encode(t) for t in texts]
    ratios = []
    for _ in range(args.runs):
        sync, async_ = (first_token_seconds(model, prompts, mode) for mode in ("sync", "async"))
        ratios.append(sum(async_) / sum(sync))
        print(f"mean time to first token, async / sync: {ratios[-1]:.2f}", flush=True)
    print(f"range over {args.runs} runs: {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
