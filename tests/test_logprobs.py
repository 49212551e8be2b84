"""Logprobs on the device: the sampled tokens' (SamplingParams.logprobs) and a prompt's (prompt_logprobs),
checked against Hugging Face's forward, equal in both loops and whatever shares the batch, and free:
asking for them changes no token."""

import pytest
import torch

import minibatch
from minibatch.core.engine import Engine
from minibatch.core.requests import MAX_LOGPROBS, Request, RequestState, SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return minibatch.load_model("tiny", device="cpu")


def _reference(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model.hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _run(model, requests, mode, **config):
    with Engine(model) as engine:
        engine.start(requests, mode, **config)
        while engine.has_work():
            engine.step()
        engine.finish()  # (raises if a KV block was not given back)
    return requests


def _work(tiny):
    tok = tiny.tokenizer
    texts = ["The for statement", "A class definition in Python", "Exceptions", "Lists hold"]
    kinds = [dict(logprobs=3, prompt_logprobs=2), dict(logprobs=0, temperature=0.8, seed=4), dict(),
             dict(prompt_logprobs=1, max_new_tokens=0)]
    return [Request(i, tok.encode(t), SamplingParams(**{"max_new_tokens": 7, **k})) for i, (t, k) in
            enumerate(zip(texts, kinds))]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_logprobs_match_the_model_and_change_no_token(tiny, mode):
    # a budget of 8 tokens: the prompts are scored across several prefill chunks, beside decoding requests
    requests = _run(tiny, _work(tiny), mode, max_batch_tokens=8, max_batch_size=4)
    plain = _run(tiny, [Request(r.rid, r.prompt, r.params.replace(logprobs=None, prompt_logprobs=None)
                                if r.params.max_new_tokens else r.params) for r in _work(tiny)], mode,
                 max_batch_tokens=8, max_batch_size=4)
    assert [r.output for r in requests] == [r.output for r in plain]  # asking for logprobs changes no token
    for r in requests:
        ref = _reference(tiny, r.prompt + r.output)
        want = r.params.logprobs
        assert len(r.logprobs) == (len(r.output) if want is not None else 0)
        for k, t in enumerate(r.logprobs):
            pos = len(r.prompt) - 1 + k
            assert t.token == r.output[k] and t.logprob == pytest.approx(ref[pos, t.token].item(), abs=1e-4)
            assert len(t.top) == want
            if want:
                top = ref[pos].topk(want)
                assert [i for i, _ in t.top] == top.indices.tolist()
                assert [v for _, v in t.top] == pytest.approx(top.values.tolist(), abs=1e-4)
                if r.params.temperature == 0:
                    assert t.top[0][0] == t.token  # greedy: the token is the top-1
        if r.params.prompt_logprobs is None:
            assert r.prompt_logprobs == []
            continue
        assert [t.token for t in r.prompt_logprobs] == r.prompt[1:]
        assert [t.logprob for t in r.prompt_logprobs] == pytest.approx(
            [ref[p, r.prompt[p + 1]].item() for p in range(len(r.prompt) - 1)], abs=1e-4)
        assert all(len(t.top) == r.params.prompt_logprobs for t in r.prompt_logprobs)
    scored = requests[3]  # max_new_tokens=0: the prompt scored, nothing generated, its blocks back
    assert scored.output == [] and scored.finish_reason == "length" and scored.state is RequestState.FINISHED


def test_logprobs_do_not_depend_on_the_batch(tiny):
    alone = [_run(tiny, [Request(0, r.prompt, r.params)], "sync")[0] for r in _work(tiny)]
    together = _run(tiny, _work(tiny), "async", max_batch_tokens=8, max_batch_size=4)
    for a, b in zip(alone, together):
        assert a.output == b.output
        assert [t.logprob for t in a.logprobs + a.prompt_logprobs] == pytest.approx(
            [t.logprob for t in b.logprobs + b.prompt_logprobs], abs=1e-4)  # (float32 sums in another order)


@pytest.mark.parametrize("options, words", [
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs must be an integer in [0, 20]"),
    (dict(prompt_logprobs=-1), "prompt_logprobs must be an integer in [0, 20]"),
    (dict(logprobs=True), "logprobs must be an integer"),
    (dict(max_new_tokens=0), "0 only scores a prompt"),
])
def test_bad_logprob_options_are_named(options, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**options)


# --- min_tokens: the end-of-sequence ids held back on the device -------------------------------------

@pytest.mark.parametrize("mode", ["sync", "async"])
def test_min_tokens_holds_eos_back_as_hugging_face_does(tiny, mode):
    """Greedy, the tiny model ends this prompt at once; with min_tokens it may not before that many
    tokens, and the tokens are Hugging Face generate's with min_new_tokens (its logits processor)."""
    tok = tiny.tokenizer
    quick = tok.encode("User: Hello!\nAssistant:")
    eos = tok.eos_token_id
    assert minibatch.generate(tiny, [quick], eos_token_id=eos, max_new_tokens=8)[0][-1] == eos  # ends early
    for min_tokens in (3, 8):
        got = minibatch.generate(tiny, [quick, quick[:-3]], eos_token_id=eos, max_new_tokens=12, mode=mode,
                                 min_tokens=min_tokens, max_batch_tokens=8)
        for prompt, out in zip((quick, quick[:-3]), got):
            assert eos not in out[:min_tokens] and len(out) > min_tokens - 1
            ref = tiny.hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=min_tokens,
                                   do_sample=False, eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].tolist()
            assert out == ref, (min_tokens, out, ref)


def test_min_tokens_is_checked():
    with pytest.raises(ValueError, match="min_tokens must be an integer in"):
        SamplingParams(max_new_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="at most 8 end-of-sequence ids"):
        SamplingParams(min_tokens=1, eos_token_id=list(range(9)))
