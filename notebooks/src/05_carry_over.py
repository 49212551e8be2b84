# %% [markdown]
# # 05 · Carry-over: using tokens you do not have yet
#
# **What you will learn:** why the asynchronous loop must build batch N+1 before batch N's sampled
# tokens exist; how a **placeholder 0** and a **carry-over mask** let the device patch those tokens
# in by itself, with four small tensor operations; what the model writes when you forget to; and
# how a request that stops with EOS in batch N but already sits in batch N+1 is cut at the right
# place.
#
# **Time:** about 10 minutes (CPU or GPU).
#
# Notebook 04 gave us two IO slots, so the host can write batch N+1 while the device still reads
# batch N. That solves the *data corruption* hazard. This notebook solves the second one, the
# *data transmission* hazard: batch N+1 needs tokens that batch N is still computing.

# %%
import os

import matplotlib.pyplot as plt
import torch

import minibatch
from minibatch.core.batch import build_batch
from minibatch.core.requests import Request, RequestState, SamplingParams
from minibatch.core.scheduler import Scheduler

torch.manual_seed(0)
# figures go to out/figures, which git ignores; `scripts/build_notebooks.py --figures` writes the
# tracked ones in figures/
FIGURES = os.environ.get("MINIBATCH_FIGURES", "../out/figures")
os.makedirs(FIGURES, exist_ok=True)
torch.set_num_threads(1)  # the tiny model gains nothing from more; on a busy 2-core machine two threads stall
model = minibatch.load_model("tiny", device="cpu")
tok = model.tokenizer
EOS = tok.eos_token_id

# %% [markdown]
# ## 1. The problem: planning batch N+1 one step early
#
# In the synchronous loop of notebook 01 the host calls `scheduler.update(plan, tokens)` with
# batch N's tokens *before* it plans batch N+1. The asynchronous loop cannot afford that wait: it
# plans and builds batch N+1 while the device runs batch N, and hands batch N's tokens to their
# requests only afterwards.
#
# Let us do exactly that with a real scheduler. Four requests, a budget of 12 tokens; request 0
# may generate only 3 tokens. We run two ordinary steps, then let the device compute batch N
# (step 2) and, *before* calling `update` for it, plan batch N+1 (step 3).

# %%
def show(plan):
    parts = [f"r{c.request.rid}[{c.start}:{c.end}]{'→sample' if c.sample else ''}" for c in plan.chunks]
    print(f"step {plan.step}: {plan.num_tokens:2} tokens  " + "  ".join(parts))


texts = ["Names", "The for statement", "A class", "See also"]
cache = model.make_cache(num_blocks=32, block_size=8)
sched = Scheduler(cache.allocator, max_batch_tokens=12, max_batch_size=4)
requests = [Request(i, tok.encode(t), SamplingParams(0.7, seed=3 + i, max_new_tokens=3 if i == 0 else 8,
                    eos_token_id=EOS)) for i, t in enumerate(texts)]
for r in requests:
    sched.add(r)

for _ in range(2):  # steps 0 and 1, synchronously as in notebook 01
    plan = sched.schedule()
    sched.update(plan, model.next_tokens(build_batch(plan, cache), cache).tolist())

plan_n = sched.schedule()                              # batch N
out_n = model.next_tokens(build_batch(plan_n, cache), cache)  # the device computes it; the host has not read it
plan_next = sched.schedule()                           # batch N+1, planned BEFORE update(N)
batch_next = build_batch(plan_next, cache)
show(plan_n)
show(plan_next)
print("batch N+1 input_ids:", batch_next.input_ids.tolist())

# %% [markdown]
# Batch N samples three tokens: the last one of request 0, and the first ones of requests 1 and 2
# (their prompts end in this step). Request 3 only starts its prompt. In batch N+1, requests 1 and
# 2 decode: the input of each is the token it sampled in batch N, which the host does not know.
# `build_batch` wrote a **placeholder 0** there (the first two ids). Request 3's prompt chunk is
# known and written normally. Request 0 reached its 3 tokens, and since the scheduler counts
# tokens when it *plans* them, it knows that in advance and did not plan it again.
#
# 0 is a perfectly valid token id (the NUL byte), so nothing would crash if we ran batch N+1 as it
# is: the model would just read the wrong text. We come back to that in section 5.
#
# ## 2. The carry-over mask
#
# The host cannot know the tokens, but it knows *where they go*. For each row of batch N's output
# (one per sampling chunk, in plan order) the **carry-over mask** holds the index in batch N+1's
# input ids that receives the token, or -1 if it goes nowhere. Inline, in a few lines: because the
# host is exactly one step behind, every decode token of batch N+1 is a token batch N samples.

# %%
def inline_mask(plan_n, plan_next):
    where, offset = {}, 0
    for c in plan_next.chunks:
        if c.start >= len(c.request.prompt):  # a decode token: its input is being sampled in batch N
            where[c.request.rid] = offset
        offset += c.num_tokens
    return [where.get(c.request.rid, -1) for c in plan_n.sampling_chunks]


mask = inline_mask(plan_n, plan_next)
for c, m in zip(plan_n.sampling_chunks, mask):
    print(f"output row of r{c.request.rid} -> " + (f"input_ids[{m}] of batch N+1" if m >= 0 else "-1 (nowhere)"))

# %% [markdown]
# ## 3. The four device operations
#
# The patch must happen **on the device**, after batch N's sampling wrote its output and before
# batch N+1's forward pass reads its input ids, without any trip through the host. It has to have
# the same shapes every step (so a CUDA graph can hold it, notebook 04) and no Python decision
# that depends on tensor values. Four operations do it. First on a toy batch with plain tensors:

# %%
prev_output = torch.tensor([17, 42, 99])   # batch N's sampled tokens (on the device)
toy_mask = torch.tensor([3, -1, 0])        # where each goes in batch N+1; -1 = nowhere
input_ids = torch.tensor([0, 5, 6, 0])     # batch N+1 as the host built it; 0 = placeholder

tokens = prev_output[: len(toy_mask)]                                             # 1. gather
tokens = torch.where(toy_mask >= 0, tokens, 0)                                    # 2. zero
placed = torch.zeros_like(input_ids).index_add(0, toy_mask.clamp(min=0), tokens)  # 3. place
patched = input_ids + placed                                                      # 4. add
for name, t in [("gathered", prev_output[: len(toy_mask)]), ("zeroed", tokens), ("placed", placed),
                ("patched", patched)]:
    print(f"{name:9} {t.tolist()}")

# %% [markdown]
# The -1 row is zeroed, then "placed" at index 0 (clamped) where it adds nothing. The addition
# writes the tokens because every placeholder is 0 and every other position receives 0.
#
# Why not simply `input_ids[toy_mask[keep]] = prev_output[keep]` with `keep = toy_mask >= 0`?
# Boolean indexing makes a tensor whose *size depends on the data*: on a GPU, PyTorch must copy the
# count to the host to allocate it, a hidden synchronization in the middle of the loop we are
# trying to keep free of them, and a CUDA graph cannot capture it. (The exercise asks you to write
# a scatter version that avoids this.)
#
# **Beside the article.** The article lists its four operations as *select* (batch N's output
# tokens), *zero* (those not carried over), *truncate* (to batch N+1's length) and *add*. Ours are
# *gather* (the first `len(mask)` output rows), *zero* (rows whose mask is -1), *place* (`index_add`
# to the position the mask names) and *add*. Same idea, a different mask: ours is indexed by batch
# N's output row and names a destination, so placing is an operation of its own and nothing needs
# truncating (the placed tensor already has batch N+1's length); in the article's version the
# selection lines the tokens up with batch N+1's positions and truncation cuts the rest. Either way:
# fixed shapes, no host round trip, placeholders 0 so that adding writes.
#
# **How big is an IO slot?** The article notes that doubling the IO tensors costs little *when no
# attention mask is needed*: a flash-attention kernel reads the paged cache through each request's
# block table and cumulative lengths, a few numbers per request. Our attention (SDPA or an einsum
# over gathered keys, `minibatch/model/attention.py`) needs the keys laid out and masked, so each slot also
# carries a key list, three int64 entries per key read (`kv_indices`, `kv_seq`, `kv_pos`); the device
# builds the boolean mask from them. For the decode step of the H200 runs (32 rows, contexts up to
# 512 tokens, keys padded to multiples of 64):

# %%
def io_sizes(rows=32, context=512, kv_bucket=64, block_size=16):
    """Bytes of one decode step's IO tensors (ours) and of what a flash-attention kernel reads instead."""
    keys = rows * -(-(context + 1) // kv_bucket) * kv_bucket  # the decode layout: [rows, L] keys
    return {"per-token inputs": 4 * rows * 8,  # input_ids, positions, q_seq, cell_mapping: int64 per token
            "key lists": 3 * keys * 8,  # kv_indices, kv_seq, kv_pos
            "device mask": keys,  # the boolean mask built on the device, one byte per (row, key)
            "block tables + lengths": rows * -(-context // block_size) * 4 + (rows + 1) * 4}


print(" | ".join(f"{name} {size / 1e3:.1f} kB" for name, size in io_sizes().items()))

# %% [markdown]
# So our slots are about a hundred times larger than they would need to be with a flash kernel,
# and still under half a megabyte each: two of them cost nothing next to 16 GB of weights. A mixed
# prefill/decode step with the flat layout is larger: its mask is [tokens, keys], e.g. 512 prefill
# tokens against 8192 keys is 4 MB, built on the device, not copied. The Triton decode kernel
# (`minibatch/model/triton_decode.py`, notebook 07) reads the block tables in place, as flash attention does.
#
# Now the same four lines on the real pair of batches from section 1, with batch N's real
# output:

# %%
def inline_carry_over(input_ids, prev_output, mask):
    tokens = torch.where(mask >= 0, prev_output[: len(mask)], 0)
    return input_ids + torch.zeros_like(input_ids).index_add(0, mask.clamp(min=0), tokens)


real_mask = torch.tensor(mask)
patched_next = inline_carry_over(batch_next.input_ids, out_n, real_mask)
print("batch N output     ", out_n.tolist(), repr(tok.decode(out_n.tolist())))
print("batch N+1 host ids ", batch_next.input_ids.tolist())
print("after carry-over   ", patched_next.tolist())

# %% [markdown]
# ## 4. The package version, checked
#
# `minibatch.core.carry_over` has both halves: `carry_over_mask(prev_plan, plan)` runs on the host
# when it builds batch N+1, and `apply_carry_over(out_ids, input_ids, prev_output, mask)` runs on
# the device, inside the compute step. It writes its result into a separate buffer rather than in
# place, so that running it twice gives the same answer (a CUDA graph's warm-up run and its replay
# both run it). Both must agree with our inline versions, and the patched ids must be *exactly* what
# the synchronous loop would have fed: we check that by now calling `update` for batch N and
# building batch N+1 again, the slow way.

# %%
from minibatch.core.carry_over import apply_carry_over, carry_over_mask

assert carry_over_mask(plan_n, plan_next) == mask
pkg_patched = torch.empty_like(batch_next.input_ids)
apply_carry_over(pkg_patched, batch_next.input_ids, out_n, real_mask)
assert torch.equal(pkg_patched, patched_next)

sched.update(plan_n, out_n.tolist())  # batch N's tokens reach the host at last
assert torch.equal(build_batch(plan_next, cache).input_ids, patched_next)
print("carry_over_mask == inline mask, apply_carry_over == four inline ops == what sync would feed ✓")

# %% [markdown]
# A picture of the same data: batch N's output rows on top, the arrows are the mask, batch N+1's
# input ids as the host wrote them in the middle (dashed: placeholders), and what the forward
# pass reads at the bottom.

# %%
def label(t):
    return {tok.bos_token_id: "BOS", EOS: "EOS"}.get(t, repr(chr(t)))


def draw_carry_over(plan_n, plan_next, out, mask, host_ids, patched, ax):
    colours = plt.get_cmap("tab10")
    owner = [c.request.rid for c in plan_next.chunks for _ in range(c.num_tokens)]
    rows = plan_n.sampling_chunks
    x0 = (len(host_ids) - len(rows)) / 2  # centre the output row
    for i, (c, t) in enumerate(zip(rows, out)):
        ax.add_patch(plt.Rectangle((x0 + i, 2), 0.9, 0.6, color=colours(c.request.rid), alpha=0.35))
        ax.text(x0 + i + 0.45, 2.3, f"r{c.request.rid}: {label(t)}\n{t}", ha="center", va="center", fontsize=8)
        goes_nowhere = mask[i] < 0
        ax.text(x0 + i + 0.45, 2.75, f"mask {mask[i]}" + (" ✗" if goes_nowhere else ""), ha="center", fontsize=8,
                color="red" if goes_nowhere else "black")
        if mask[i] >= 0:
            ax.annotate("", xy=(mask[i] + 0.45, 1.2), xytext=(x0 + i + 0.45, 2),
                        arrowprops=dict(arrowstyle="->", color=colours(c.request.rid), lw=1.5))
        else:  # goes nowhere: a red frame and cross on its own box, clear of the other rows' arrows
            ax.add_patch(plt.Rectangle((x0 + i, 2), 0.9, 0.6, fill=False, edgecolor="red", lw=1.2))
    for y, ids, dashed in ((0.6, host_ids, True), (-0.6, patched, False)):
        for j, t in enumerate(ids):
            hole = dashed and j in mask
            ax.add_patch(plt.Rectangle((j, y), 0.9, 0.6, facecolor=colours(owner[j]), alpha=0.35,
                                       edgecolor="black" if hole else "none", linestyle="--"))
            ax.text(j + 0.45, y + 0.3, "0" if hole else f"{label(t)}\n{t}", ha="center", va="center", fontsize=8)
    for j in range(len(host_ids)):
        ax.text(j + 0.45, 0.45, f"[{j}]", ha="center", va="center", fontsize=7, color="grey")
    ax.text(-0.2, 2.3, "batch N output", ha="right", va="center")
    ax.text(-0.2, 0.9, "batch N+1 input_ids\n(host, placeholders)", ha="right", va="center")
    ax.text(-0.2, -0.3, "after carry-over\n(device)", ha="right", va="center")
    ax.set_xlim(-3.2, len(host_ids) + 0.2)
    ax.set_ylim(-0.8, 3.0)
    ax.axis("off")


fig, ax = plt.subplots(figsize=(9, 3.2))
draw_carry_over(plan_n, plan_next, out_n.tolist(), mask, batch_next.input_ids.tolist(), patched_next.tolist(), ax)
ax.set_title(f"carry-over from step {plan_n.step} to step {plan_next.step} (colour = request)")
fig.tight_layout()
fig.savefig(f"{FIGURES}/05_carry_over_mask.png", dpi=110)

# %% [markdown]
# ## 5. What goes wrong without carry-over
#
# Time to run whole generations the way the asynchronous loop orders its work. We do it in one
# thread, with no streams, so every output is exact and repeatable: plan and build batch N+1
# (placeholders in), let the "device" patch it and run it, and only then hand batch N's tokens to
# the host. Notebook 06 adds the concurrency. With `carry=False` the placeholders go in as they are.
#
# Sampling at temperature 0.7 (seeded per request, as `minibatch.generate` does), since greedy
# decoding of a model this small loops and would hide the damage.

# %%
def one_step_behind(model, prompts, max_new_tokens, carry=True, seed=3, budget=32, seats=4):
    cache = model.make_cache(num_blocks=64, block_size=8)
    sched = Scheduler(cache.allocator, budget, seats)
    params = SamplingParams(0.7, max_new_tokens=max_new_tokens, eos_token_id=EOS)
    reqs = [Request(i, p, params.replace(seed=seed + i)) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    prev, dropped = None, []  # prev: (plan, sampled tokens) of the batch whose tokens the host has not read
    while sched.has_work():
        launched = None
        if sched.has_unplanned_work():
            plan = sched.schedule()                       # host: plan N+1, N's tokens unknown
            if plan.chunks:
                batch = build_batch(plan, cache)          # placeholders 0
                if carry and prev is not None:            # device: patch them from N's output
                    ids = torch.empty_like(batch.input_ids)
                    apply_carry_over(ids, batch.input_ids, prev[1], torch.tensor(carry_over_mask(prev[0], plan)))
                    batch.input_ids = ids
                launched = (plan, model.next_tokens(batch, cache))  # device: run N+1
        if prev is not None:                              # host: N's tokens arrive
            plan_done, out = prev
            dropped += [(plan_done.step, c.request.rid, t) for c, t in zip(plan_done.sampling_chunks, out.tolist())
                        if c.request.state == RequestState.FINISHED]
            sched.update(plan_done, out.tolist())
        prev = launched
    return [r.output for r in reqs], dropped


prompts = [tok.encode(t) for t in ["A class definition", "Exceptions are raised", "The import system"]]
kw = dict(max_new_tokens=80, temperature=0.7, seed=3, eos_token_id=EOS, max_batch_tokens=32, max_batch_size=4)
reference = minibatch.generate(model, prompts, mode="sync", **kw)
broken, _ = one_step_behind(model, prompts, 80, carry=False)
fixed, _ = one_step_behind(model, prompts, 80, carry=True)
for p, b, f in zip(prompts, broken, fixed):
    print("without carry-over:", repr(tok.decode(p + b)))
    print("with carry-over:   ", repr(tok.decode(p + f)))
    print()
assert fixed == reference and broken != reference
print("with carry-over, one step behind == the synchronous loop ✓")

# %% [markdown]
# Without carry-over the model never sees the tokens it generates: each one reaches it as a NUL
# byte, so it reads "A class definition\0\0\0…" and its output dissolves into punctuation. No
# error, no crash, just wrong text, which is why a test that compares against the synchronous loop
# (`tests/test_async.py`) is what catches this kind of bug. With carry-over the text is
# byte for byte the synchronous loop's.
#
# ## 6. EOS in flight
#
# One case the host cannot plan for: a request that samples **EOS** in batch N. When the host
# planned batch N+1, that token was not known, so the request is in batch N+1 anyway; carry-over
# even feeds it its EOS as input. The device computes one token too many. The host must drop it:
# `Scheduler.update` skips rows whose request is already finished.

# %%
prompts = [tok.encode(t) for t in ["The for statement", "A class definition", "Exceptions are raised"]]
kw = dict(max_new_tokens=60, temperature=0.7, seed=13, eos_token_id=EOS, max_batch_tokens=32, max_batch_size=4)
reference = minibatch.generate(model, prompts, mode="sync", **kw)
outs, dropped = one_step_behind(model, prompts, 60, seed=13)
for step, rid, t in dropped:
    n = len(outs[rid])
    print(f"request {rid} sampled EOS as its token {n} (step {step - 1}); step {step} had it already, "
          f"sampled {label(t)}: dropped")
for p, o in zip(prompts, outs):
    print(f"{len(o):2} tokens, {'EOS' if o[-1] == EOS else 'length'}: {tok.decode(p + o)!r}")
assert outs == reference
print("outputs stop exactly where the synchronous loop's stop ✓")

# %% [markdown]
# (The dropped token is BOS: after the end of a paragraph, this model likes to start a new one.)
#
# Two more things happen behind the scenes. The request's KV blocks are freed when the host
# updates batch N, while batch N+1 (still running) writes that extra token's key and value into
# them. That is harmless: the device runs batches in order, so batch N+1 is done before any later
# batch can give those blocks to a new request. And a request that ends by *length* is never
# planned one step too far (request 0 in section 1): the scheduler counts tokens when it plans
# them, so it knows in advance; only EOS comes as a surprise.
#
# ## Summary
#
# * The asynchronous host plans batch N+1 before batch N's tokens exist. It writes a placeholder
#   0 for each token still in flight, and a carry-over mask: for each output row of batch N, its
#   destination in batch N+1's input ids, or -1.
# * On the device, before the forward pass: gather, zero, place, add. Fixed shapes, no host sync,
#   so a CUDA graph can hold it (`minibatch.core.carry_over`).
# * Forget it and the model reads NUL bytes: no error, wrong text.
# * A request that hits EOS in batch N still runs in batch N+1; its extra token is dropped, so the
#   output ends exactly where the synchronous loop's does.
# * Next, in **06**, all the pieces run together: two slots, three streams, events and carry-over,
#   in the full asynchronous loop, with a live timeline.
#
# ## Exercise
#
# Write `scatter_carry_over(input_ids, prev_output, mask)` that returns a **new** tensor: batch
# N+1's ids with the carried-over tokens *written* at their positions (a scatter, e.g.
# `Tensor.scatter` or `Tensor.index_copy`) instead of added. Keep it device-friendly: no
# `.tolist()`, `.item()` or Python loop over the rows, and no boolean indexing (the check records
# the PyTorch operations your function runs and tells you if it finds one). Hint: send the rows
# whose mask is -1 to one extra scratch position past the end, then cut it off.

# %%
scatter_carry_over = None  # replace with your function

# %%
import exercises

exercises.check_05(globals().get("scatter_carry_over"))
