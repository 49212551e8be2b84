# %% [markdown]
# # 00 · Welcome: your machine, your device, a model that speaks
#
# **What you will learn:** what this workshop builds, how to check your set-up, which *device*
# (CPU or NVIDIA GPU) the code will run on, and how to make the tiny model that ships with
# `minibatch` write text.
#
# **Time:** about 5 minutes (CPU or GPU).
#
# Over the next notebooks we build, piece by piece, the loop at the heart of an LLM inference
# server: **continuous batching**. First the simple synchronous version, in which the CPU and the
# GPU take turns; then the tools to make them work at the same time (CUDA streams, events,
# double-buffered slots, CUDA graphs); and finally the asynchronous loop of the Hugging Face
# article *Unlocking asynchronicity in continuous batching* (May 2026), where the GPU is busy
# more than 99% of the time.
#
# Everything runs on a laptop without a GPU: `minibatch` emulates a GPU's streams on the CPU, so
# the overlaps and the race conditions you will see are real, not drawn.

# %% [markdown]
# ## 1. Check the environment
#
# The numbers printed below depend on your machine; what matters is that every import works.

# %%
# NBVAL_IGNORE_OUTPUT
import platform

import torch
import transformers

import minibatch

torch.manual_seed(0)
print("python      ", platform.python_version())
print("torch       ", torch.__version__)
print("transformers", transformers.__version__)
print("minibatch   ", minibatch.__version__)

# %% [markdown]
# ## 2. Which device?
#
# `minibatch.load_model(..., device="auto")` picks the GPU when PyTorch sees one, and the CPU
# otherwise. The outputs stored in these notebooks were made on a CPU; with a GPU your numbers
# will differ.

# %%
# NBVAL_IGNORE_OUTPUT
from minibatch.core.args import resolve_device

device = resolve_device("auto")
print("device:", device)
if device.type == "cuda":
    print("GPU:", torch.cuda.get_device_name(device))

# %% [markdown]
# ## 3. The tiny model
#
# `minibatch` ships a small Llama-style model (about 1.3 million parameters, 2.7 MB) trained on
# the English help text that comes with Python itself. It reads and writes single **bytes**: the
# letter `a` is token 97. Three extra tokens mark the beginning of a text (BOS), its end (EOS) and
# padding. We load it on the CPU here so that every student sees the same output.

# %%
model = minibatch.load_model("tiny", device="cpu")
tok = model.tokenizer
cfg = model.hf.config
print(f"{type(model.hf).__name__}: {sum(p.numel() for p in model.hf.parameters()):,} parameters")
print(f"{cfg.num_hidden_layers} layers, hidden size {cfg.hidden_size}, "
      f"{cfg.num_attention_heads} query heads sharing {cfg.num_key_value_heads} key/value heads")
print("vocabulary:", tok.vocab_size, "tokens")
ids = tok.encode("Hello")
print("'Hello' ->", ids, "->", repr(tok.decode(ids)))

# %% [markdown]
# ## 4. The model speaks
#
# First the way you would do it with Hugging Face `transformers` alone: `model.generate` on one
# prompt, greedy decoding (always the most likely next byte).

# %%
prompt = "The for statement"
input_ids = torch.tensor([tok.encode(prompt)])
hf_out = model.hf.generate(input_ids, max_new_tokens=60, do_sample=False, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
hf_new = hf_out[0, input_ids.shape[1]:].tolist()
print(prompt + tok.decode(hf_new))

# %% [markdown]
# Now the same prompt through `minibatch.generate`, the function the whole workshop builds. It
# runs our own continuous-batching loop with our own paged KV cache, plugged into the unchanged
# transformers model. Greedy decoding must give the very same bytes:

# %%
ours = minibatch.generate(model, [prompt], max_new_tokens=60, eos_token_id=tok.eos_token_id)[0]
print(prompt + tok.decode(ours))
assert ours == hf_new, "minibatch and Hugging Face generate disagree"
print("\nsame tokens as Hugging Face generate ✓")

# %% [markdown]
# Plausible-looking documentation English that soon repeats itself: greedy decoding from a model
# this small falls into loops. The model is a toy, and that is enough for us.
#
# `minibatch.generate` takes many prompts at once and returns one list of new tokens per prompt,
# in order. A few prompts, with sampling this time (temperature 0.7, seeded, so reproducible): the
# text varies, and a request stops either by itself, with EOS, or at the 200-token limit: the
# output says which, for each.
# When a token is sent to the wrong request later on, you will *see* it as garbage in the text.

# %%
prompts = ["A class definition", "Exceptions are raised", "The import system"]
outs = minibatch.generate(model, prompts, max_new_tokens=200, temperature=0.7, seed=3,
                          eos_token_id=tok.eos_token_id)
for p, o in zip(prompts, outs):
    end = "EOS" if o[-1] == tok.eos_token_id else "length"
    print(f"{p!r} ({len(o)} tokens, stopped by {end}):\n    {tok.decode(o)!r}")

# %% [markdown]
# ## 5. The package you will build
#
# What `generate` just ran lives in `minibatch/core/`, a folder small enough to read in a few
# sittings: it imports nothing else of `minibatch`. Each of the next notebooks builds one piece of it
# in a few lines first, then opens the file that does the same. The map (its `__init__` docstring)
# says which notebook explains which file; what is not in the core (the emulated GPU, the
# transformers model, torch.compile, the HTTP server, the benchmarks) plugs into it from outside.

# %%
import minibatch.core

print(minibatch.core.__doc__)

# %% [markdown]
# ## Summary
#
# * `minibatch.load_model` loads a transformers model (the built-in `"tiny"`, a local folder, a hub
#   id, or a model you built) and plugs our paged KV cache into its attention.
# * `minibatch.generate(model, prompts, ...)` continues many prompts at once and agrees token for
#   token with Hugging Face `generate` under greedy decoding.
# * The loop behind it is `minibatch/core/`; the notebooks build it file by file.
# * Next, in **01**, we open the box: the synchronous continuous-batching loop, step by step.
#
# ## Exercise
#
# Write `count_until_eos(model, prompt, seed)` that returns how many new tokens the tiny model makes
# for `prompt` when it samples as in the cell above (temperature 0.7, this `seed`, at most 200 new
# tokens) before it stops by itself with EOS, EOS included. Then run the check cell (it picks prompts
# and seeds for which the model does stop).

# %%
count_until_eos = None  # replace with your function

# %%
import exercises

exercises.check_00(globals().get("count_until_eos"))
