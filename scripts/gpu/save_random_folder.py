"""Save a built-in random-weight shape (model.py's RANDOM_CONFIGS) as a model folder any server can load.

    python scripts/gpu/save_random_folder.py llama3-8b-shape FOLDER [--device cuda] [--dtype bfloat16]

The weights are built as `load_model` builds them (same config, same seed) but saved from the plain
transformers model: `load_model` on a GPU packs sibling projections into one tensor (siblings.py), which
is not the checkpoint layout. The random shapes have no tokenizer, so the folder gets a word-level one:
bench-serve's word list first (one token per word, so a prompt of N words is exactly N tokens plus BOS in
every server that loads this folder), then filler words `w0`, `w1`, ... up to the vocabulary size; a chat
template that joins the messages' contents, for servers that only speak chat.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from minibatch.model.model import RANDOM_CONFIGS  # noqa: E402
from minibatch.serving.bench_serve import WORDS  # noqa: E402

SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: Llama's default BOS (1) and EOS (2)


def word_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    words = SPECIALS + list(WORDS)
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # tokens joined by spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return fast


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shape", choices=sorted(RANDOM_CONFIGS))
    p.add_argument("folder")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cls_name, kwargs = RANDOM_CONFIGS[args.shape]
    config = getattr(transformers, cls_name)(**{**kwargs, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    hf.save_pretrained(args.folder)
    word_tokenizer(config.vocab_size).save_pretrained(args.folder)
    print(f"saved {args.shape} ({args.dtype}) and a {config.vocab_size}-word tokenizer to {args.folder}")


if __name__ == "__main__":
    main()
