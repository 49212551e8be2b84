"""Presence, frequency and repetition penalties (core/penalties.py): the tokens a plain host loop over Hugging
Face's forward gives, and Hugging Face's own `generate(repetition_penalty=...)`; the same in both loops and
whatever shares the batch; bad values refused by name."""

import pytest
import torch

import minibatch
from minibatch.core.engine import Engine
from minibatch.core.requests import Request, SamplingParams

TEXTS = ["The for statement", "A class definition in Python", "Exceptions", "Lists hold", "def main"]
KINDS = [dict(repetition_penalty=1.3), dict(frequency_penalty=1.5), dict(presence_penalty=1.5, frequency_penalty=-0.3),
         dict(), dict(repetition_penalty=0.8, presence_penalty=0.4)]


@pytest.fixture(scope="module")
def tiny():
    return minibatch.load_model("tiny", device="cpu")


def _run(model, requests, mode, **config):
    with Engine(model) as engine:
        engine.start(requests, mode, **config)
        while engine.has_work():
            engine.step()
        engine.finish()
    return [r.output for r in requests]


def _requests(tiny, new=16, **extra):
    return [Request(i, tiny.tokenizer.encode(t), SamplingParams(max_new_tokens=new, seed=i, **k, **extra))
            for i, (t, k) in enumerate(zip(TEXTS, KINDS))]


def _host_loop(model, prompt, p: SamplingParams) -> list[int]:
    """Greedy decoding written out: the full forward each token, the penalties applied to its logits by hand."""
    ids, out = list(prompt), []
    for _ in range(p.max_new_tokens):
        with torch.no_grad():
            logits = model.hf(torch.tensor([ids])).logits[0, -1].float()
        for tok in set(ids):  # repetition: every token seen in the prompt or the output
            v = logits[tok]
            logits[tok] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for tok in set(out):
            logits[tok] -= p.frequency_penalty * out.count(tok) + p.presence_penalty
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_greedy_penalties_match_a_host_loop(tiny, mode):
    # a budget of 8 tokens: prompts prefill over several chunks beside decoding rows, some penalized, some not
    got = _run(tiny, _requests(tiny), mode, max_batch_tokens=8, max_batch_size=3)
    for r, out in zip(_requests(tiny), got):
        assert out == _host_loop(tiny, r.prompt, r.params), r.params


def test_penalties_change_the_tokens(tiny):
    """Not a test that cannot fail: on these prompts, every penalized request decodes otherwise than without."""
    got = _run(tiny, _requests(tiny), "sync")
    plain = _run(tiny, [Request(r.rid, r.prompt, SamplingParams(max_new_tokens=16)) for r in _requests(tiny)], "sync")
    assert [a != b for a, b in zip(got, plain)] == [bool(k) for k in KINDS]


def test_repetition_penalty_matches_hugging_face_generate(tiny):
    for r, out in zip(_requests(tiny), _run(tiny, _requests(tiny), "async")):
        if set(KINDS[r.rid]) != {"repetition_penalty"}:
            continue
        ref = tiny.hf.generate(torch.tensor([r.prompt]), max_new_tokens=16, do_sample=False,
                               repetition_penalty=r.params.repetition_penalty, eos_token_id=None, pad_token_id=0)
        assert out == ref[0, len(r.prompt):].tolist()


def test_sampled_penalties_do_not_depend_on_the_loop_or_the_batch(tiny):
    together = _run(tiny, _requests(tiny, temperature=0.9, top_k=40), "async", max_batch_tokens=8, max_batch_size=4)
    assert together == _run(tiny, _requests(tiny, temperature=0.9, top_k=40), "sync")
    alone = [_run(tiny, [r], "sync")[0] for r in _requests(tiny, temperature=0.9, top_k=40)]
    assert together == alone


@pytest.mark.parametrize("name, value, says", [
    ("presence_penalty", 2.5, "presence_penalty must be a finite number in [-2, 2]"),
    ("frequency_penalty", float("nan"), "frequency_penalty must be a finite number in [-2, 2]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
    ("repetition_penalty", "1.2", "repetition_penalty must be a finite number > 0"),
])
def test_bad_penalties_are_refused_by_name(name, value, says):
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{name: value})
