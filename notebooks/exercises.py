"""Check cells for the notebooks' exercises (the solutions are in notebooks/solutions/).

Each `check_*` takes what the student wrote. If it is still None, it says so and returns; otherwise
it tests the answer and prints ✓ or raises AssertionError with a hint.
"""

from __future__ import annotations


def _not_yet(answer, name: str) -> bool:
    if answer is None:
        print(f"not attempted yet: write `{name}` in the cell above, run it, then run this cell again")
        return True
    return False


def check_00(count_until_eos) -> None:
    """count_until_eos(model, prompt: str) -> how many new tokens until (and including) EOS, at most 200."""
    if _not_yet(count_until_eos, "count_until_eos"):
        return
    import minibatch
    model = minibatch.load_model("tiny", device="cpu")
    for prompt in ("The while statement", "Names refer to objects"):
        out = minibatch.generate(model, [prompt], max_new_tokens=200, eos_token_id=model.tokenizer.eos_token_id)[0]
        got = count_until_eos(model, prompt)
        assert got == len(out), f"{prompt!r}: you counted {got}, the model made {len(out)} tokens (EOS included)"
    print("✓ correct")


def check_01(tokens_per_step) -> None:
    """tokens_per_step(plans) -> list of the number of tokens processed in each step."""
    if _not_yet(tokens_per_step, "tokens_per_step"):
        return
    from minibatch.kv_cache import BlockAllocator
    from minibatch.requests import Request
    from minibatch.scheduler import Scheduler

    sched = Scheduler(BlockAllocator(64, 4), max_batch_tokens=8, max_batch_size=3)
    for i, n in enumerate([10, 3, 7, 5]):
        sched.add(Request(i, [1] * n, 4))
    plans = []
    while sched.has_work():
        plan = sched.schedule()
        plans.append(plan)
        sched.update(plan, [2] * len(plan.sampling_chunks))
    expected = [p.num_tokens for p in plans]
    got = tokens_per_step(plans)
    assert list(got) == expected, f"expected {expected}, got {list(got)}"
    assert max(got) <= 8, "a step never processes more than max_batch_tokens"
    print("✓ correct")
