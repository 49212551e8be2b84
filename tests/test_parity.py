"""Greedy tokens of minibatch's sync loop == Hugging Face `generate`, token for token (float32, CPU)."""

import pytest
import torch

import minibatch

ARCHS = ["random-llama", "random-qwen2", "random-qwen3", "random-mistral"]


def hf_greedy(model: minibatch.Model, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """Reference: HF generate, one prompt at a time (no padding), our EOS or none at all."""
    out = model.hf.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )[0, len(prompt):].tolist()
    if eos is None:
        assert len(out) == max_new_tokens
    return out


def prompts_of(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(arch):
    model = minibatch.load_model(arch, device="cpu")
    model.hf.generation_config.eos_token_id = None
    prompts = prompts_of([5, 23, 41, 1, 9, 16, 30], model.vocab_size)
    # 7 prompts, at most 3 at a time, 8-token budget: mixed batches, chunked prefill, admissions mid-run
    outs = minibatch.generate(model, prompts, max_new_tokens=10, max_batch_size=3, max_batch_tokens=8,
                              block_size=4)
    for p, o in zip(prompts, outs):
        assert o == hf_greedy(model, p, 10, None)


def test_eos_stops_like_hf(random_llama):
    prompts = prompts_of([3, 12, 7, 20], random_llama.vocab_size, seed=1)
    # pick as EOS a token that the greedy continuation of prompt 0 emits, so at least one request stops early
    free = minibatch.generate(random_llama, prompts, max_new_tokens=12)
    eos = free[0][4]
    outs = minibatch.generate(random_llama, prompts, max_new_tokens=12, eos_token_id=eos, max_batch_size=2,
                              max_batch_tokens=6)
    assert outs[0][-1] == eos and len(outs[0]) <= 5
    for p, o in zip(prompts, outs):
        assert o == hf_greedy(random_llama, p, 12, eos)


def test_batching_does_not_change_tokens(random_llama):
    prompts = prompts_of([8, 3, 15, 6, 11], random_llama.vocab_size, seed=2)
    alone = [minibatch.generate(random_llama, [p], max_new_tokens=6)[0] for p in prompts]
    together = minibatch.generate(random_llama, prompts, max_new_tokens=6, max_batch_size=5, max_batch_tokens=64)
    assert together == alone


def test_tiny_pretrained_speaks(tiny):
    out = minibatch.generate(tiny, ["The for statement"], max_new_tokens=40)[0]
    text = tiny.tokenizer.decode(out)
    assert sum(ch.isalpha() or ch == " " for ch in text) >= 0.8 * len(text), text


def test_tiny_matches_hf_generate(tiny):
    prompts = [tiny.tokenizer.encode(s) for s in ("The for statement", "A class", "Exceptions are raised")]
    outs = minibatch.generate(tiny, prompts, max_new_tokens=24, max_batch_tokens=16, max_batch_size=2)
    for p, o in zip(prompts, outs):
        assert o == hf_greedy(tiny, p, 24, None)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["random-llama", "random-qwen3"])
def test_greedy_matches_hf_generate_on_gpu(arch):
    model = minibatch.load_model(arch, device="cuda", dtype=torch.float32)
    prompts = prompts_of([5, 23, 41, 1, 9], model.vocab_size)
    outs = minibatch.generate(model, prompts, max_new_tokens=10, max_batch_size=3, max_batch_tokens=8)
    for p, o in zip(prompts, outs):
        ref = model.hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=10, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o == ref


def test_padded_key_list_gives_the_same_tokens(random_llama):
    prompts = prompts_of([5, 23, 41], random_llama.vocab_size, seed=4)
    plain = minibatch.generate(random_llama, prompts, max_new_tokens=6, max_batch_tokens=16)
    random_llama.kv_bucket = 64
    try:
        padded = minibatch.generate(random_llama, prompts, max_new_tokens=6, max_batch_tokens=16)
    finally:
        random_llama.kv_bucket = 1
    assert padded == plain
