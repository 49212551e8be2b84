"""Train the tiny byte-level Llama that ships in ``minibatch/assets/tiny``.

What: a 4-layer Llama (about 1.3M parameters, under 3 MB in bf16) that
reads and writes raw UTF-8 bytes (see ``minibatch/model/tokenizer.py``).

Why: the teaching notebooks need a real model whose output is recognizable
English, so that a scheduling bug (a token routed to the wrong request, a
stale KV cache) is visible as garbage. It must be small enough to ship inside
the package and to run quickly on a laptop CPU. It is a toy: it babbles
Python-documentation-flavoured prose and knows nothing.

How: the training text is the English prose that ships with Python itself,
``pydoc_data.topics.topics`` (the ``help()`` topics, about 465k characters),
so no download is needed. It is split into paragraphs at blank lines; very
short ones are dropped and a few are held out for validation. Each document
is ``BOS + paragraph bytes + EOS``, so the model learns to end a paragraph
with EOS (handy for showing requests that finish at different times). The
documents are joined into one long stream, and training samples random
windows from it, with AdamW and a warmup + cosine learning rate schedule,
for a bounded wall-clock time.

Run (from the repository root; not part of CI):

    python scripts/train_tiny.py --minutes 12

The learning rate schedule runs on the fraction of the time budget used,
so training ends on time even on a busy machine (the step count then varies
from run to run); pass ``--steps`` to train for an exact number of steps
instead, which makes the run reproducible.
"""

from __future__ import annotations

import argparse
import math
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from pydoc_data.topics import topics
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from minibatch.model.tokenizer import ByteTokenizer  # noqa: E402

OUT_DIR = ROOT / "minibatch" / "assets" / "tiny"
SEED = 0
MIN_PARAGRAPH_CHARS = 40   # drop headings, lone code lines, "See also" stubs
VAL_EVERY = 50             # every 50th paragraph (after shuffling) is held out
SEQ_LEN = 256              # tokens per training window
BATCH_SIZE = 16            # windows per step
WARMUP = 0.03              # fraction of training spent warming up the learning rate


def make_config(tok: ByteTokenizer) -> LlamaConfig:
    """The architecture: small, but a real Llama (RoPE, RMSNorm, SwiGLU, GQA)."""
    return LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=192,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=6,       # head_dim = 192 / 6 = 32
        num_key_value_heads=2,       # grouped-query attention: 3 query heads per KV head
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def load_paragraphs() -> list[str]:
    """All paragraphs of the pydoc topics, in a fixed order."""
    paragraphs = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            block = block.strip("\n").rstrip()
            if len(block.strip()) >= MIN_PARAGRAPH_CHARS:
                paragraphs.append(block)
    return paragraphs


def to_stream(paragraphs: list[str], tok: ByteTokenizer) -> torch.Tensor:
    """Concatenate BOS + bytes + EOS of every paragraph into one 1-D tensor."""
    ids: list[int] = []
    for p in paragraphs:
        ids += tok.encode(p, add_bos=True) + [tok.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def random_windows(stream: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A batch of random windows of SEQ_LEN + 1 tokens (inputs plus next-token targets)."""
    starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (BATCH_SIZE,), generator=gen)
    return torch.stack([stream[s : s + SEQ_LEN + 1] for s in starts.tolist()])


def next_token_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting windows[:, 1:] from windows[:, :-1]."""
    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), windows[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, stream: torch.Tensor) -> float:
    """Mean loss over consecutive, non-overlapping windows covering the stream."""
    model.eval()
    n = (len(stream) - 1) // SEQ_LEN
    windows = torch.stack([stream[i * SEQ_LEN : (i + 1) * SEQ_LEN + 1] for i in range(n)])
    losses = [next_token_loss(model, batch).item() for batch in windows.split(BATCH_SIZE)]
    sizes = [len(batch) for batch in windows.split(BATCH_SIZE)]
    model.train()
    return sum(l * s for l, s in zip(losses, sizes)) / sum(sizes)


def lr_at(progress: float, peak: float) -> float:
    """Learning rate at ``progress`` (0..1) through training: linear warmup
    to ``peak``, then cosine decay to a tenth of it."""
    if progress < WARMUP:
        return peak * max(progress / WARMUP, 0.01)
    progress = min(1.0, (progress - WARMUP) / (1 - WARMUP))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def write_readme(args, n_params, steps, minutes, train_loss, val_loss, n_train, n_val) -> None:
    cfg = make_config(ByteTokenizer())
    (OUT_DIR / "README.md").write_text(f"""\
# tiny: a toy byte-level Llama

A `LlamaForCausalLM` with {n_params:,} parameters, stored in bfloat16.
It reads and writes UTF-8 bytes: ids 0..255 are bytes, 256 = BOS,
257 = EOS, 258 = PAD (see `minibatch/model/tokenizer.py`).

Architecture: {cfg.num_hidden_layers} layers, hidden size {cfg.hidden_size}, MLP size {cfg.intermediate_size},
{cfg.num_attention_heads} query heads sharing {cfg.num_key_value_heads} KV heads (head_dim {cfg.head_dim}), RoPE,
up to {cfg.max_position_embeddings} positions, tied input/output embeddings.

Training text: the English help text that ships with Python
(`pydoc_data.topics.topics`), split into paragraphs, each one a document
BOS + bytes + EOS: {n_train} paragraphs for training, {n_val} held out.

Training: AdamW, peak learning rate {args.lr:g}, warmup + cosine,
{steps} steps of {BATCH_SIZE} random windows of {SEQ_LEN} bytes,
{minutes:.1f} minutes on one CPU thread, seed {SEED}:

    python scripts/train_tiny.py {' '.join(sys.argv[1:])}

Final loss in nats per byte (float32, before the bf16 cast):
train {train_loss:.3f} (on a sample of the training text),
validation {val_loss:.3f} (held-out paragraphs).

This is a toy. It produces Python-documentation-flavoured English that
looks plausible at a glance and means nothing. It exists so that the
minibatch notebooks have a real model whose output you can read.
Greedy decoding soon falls into a loop ("... is a string of the statement
of the statement ..."), and different prompts often reach the same loop;
sampling (temperature about 0.7) gives more varied text and ends paragraphs
with EOS.
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=12.0, help="wall-clock budget")
    parser.add_argument("--steps", type=int, default=None, help="exact step count (overrides --minutes)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    tok = ByteTokenizer()

    paragraphs = load_paragraphs()
    random.Random(SEED).shuffle(paragraphs)
    val_paragraphs = paragraphs[::VAL_EVERY]
    train_paragraphs = [p for i, p in enumerate(paragraphs) if i % VAL_EVERY]
    train_stream = to_stream(train_paragraphs, tok)
    val_stream = to_stream(val_paragraphs, tok)
    print(f"{len(train_paragraphs)} train paragraphs ({len(train_stream):,} tokens), "
          f"{len(val_paragraphs)} validation ({len(val_stream):,} tokens)")

    model = LlamaForCausalLM(make_config(tok))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters")

    # Weight decay on matrices only, not on norm gains.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )

    gen = torch.Generator().manual_seed(SEED)
    budget_s = args.minutes * 60 * 0.97  # keep a little time for evaluating and saving
    start = time.perf_counter()

    def progress() -> float:
        """Fraction of training done: of the steps if given, else of the time budget."""
        if args.steps:
            return step / args.steps
        return (time.perf_counter() - start) / budget_s

    model.train()
    bar = tqdm(total=100, desc="train", bar_format="{l_bar}{bar}| {elapsed}<{remaining}{postfix}")
    smooth = None
    step = 0
    while (done := progress()) < 1:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(done, args.lr)
        loss = next_token_loss(model, random_windows(train_stream, gen))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1

        smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
        bar.update(min(100.0, 100 * progress()) - bar.n)
        bar.set_postfix(step=step, loss=f"{smooth:.3f}", lr=f"{optimizer.param_groups[0]['lr']:.1e}")
    bar.close()
    minutes = (time.perf_counter() - start) / 60

    train_loss = evaluate(model, train_stream[: len(val_stream) * 4])
    val_loss = evaluate(model, val_stream)
    print(f"{step} steps in {minutes:.1f} min; "
          f"loss (nats/byte): train {train_loss:.3f}, validation {val_loss:.3f}")

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(OUT_DIR)
    write_readme(args, n_params, step, minutes, train_loss, val_loss,
                 len(train_paragraphs), len(val_paragraphs))
    for f in sorted(OUT_DIR.iterdir()):
        print(f"  {f.relative_to(ROOT)}: {f.stat().st_size:,} bytes")

    prompt = torch.tensor([tok.encode("The for statement")])
    out = model.to(torch.float32).eval().generate(prompt, max_new_tokens=120, do_sample=False)
    print("sample:", repr(tok.decode(out[0].tolist())))


if __name__ == "__main__":
    main()
