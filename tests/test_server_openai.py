"""What the tools people point at a server send, through a real server process and the real `openai`
client (and LangChain's own clients): prompt lists and `n` (LangChain's and lm-eval's batches), extras (guidellm's `ignore_eos`,
`stop_token_ids`), penalties, unknown fields, and the routes beside the OpenAI ones (/tokenize, /detokenize,
/v1/models/{id}, /version, /metrics), prefix caching.
"""

import re

import httpx
import openai
import pytest

import minibatch
from test_serving import Server

PROMPTS = ["The for statement", "A class definition", "Exceptions are raised"]


@pytest.fixture(scope="module")
def server():
    s = Server("--max-batch-size", "8")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tiny():
    return minibatch.load_model("tiny", device="cpu")


def _alone(tiny, prompt: str, **options) -> str:
    tok = tiny.tokenizer
    return tok.decode(minibatch.generate(tiny, [tok.encode(prompt)], eos_token_id=tok.eos_token_id, **options)[0])


def test_a_list_of_prompts_and_n_give_one_choice_each_seeded_by_its_index(client, tiny):
    r = client.completions.create(model="tiny", prompt=PROMPTS, n=2, max_tokens=8, temperature=0.8, seed=11)
    assert [c.index for c in r.choices] == list(range(6))
    for k, c in enumerate(r.choices):  # choice k = prompt k // n, seeded seed + k
        assert c.text == _alone(tiny, PROMPTS[k // 2], max_new_tokens=8, temperature=0.8, seed=11 + k), k
    prompt_tokens = sum(len(tiny.tokenizer.encode(p)) for p in PROMPTS)  # each prompt counted once
    assert r.usage.prompt_tokens == prompt_tokens
    tok = tiny.tokenizer
    new = [minibatch.generate(tiny, [tok.encode(PROMPTS[k // 2])], eos_token_id=tok.eos_token_id, max_new_tokens=8,
                              temperature=0.8, seed=11 + k)[0] for k in range(6)]
    assert r.usage.completion_tokens == sum(len(ids) for ids in new)  # (an EOS counts: it was generated)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", prompt=PROMPTS, n=2, max_tokens=8, temperature=0.8,
                                           seed=11, stream=True):
        assert not chunk.usage  # usage only when stream_options asks for it
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in r.choices}


def test_langchain_batches_through_the_server(server, tiny):
    from langchain_openai import ChatOpenAI, OpenAI

    llm = OpenAI(base_url=server.url + "/v1", api_key="none", model="tiny", max_tokens=8, temperature=0, max_retries=0)
    assert llm.batch(PROMPTS) == [_alone(tiny, p, max_new_tokens=8) for p in PROMPTS]  # one request, a list of prompts
    chat = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="tiny", max_tokens=8, temperature=0,
                      max_retries=0)
    replies = chat.batch(["Hello", "Lists hold"])
    assert all(r.response_metadata["finish_reason"] in ("stop", "length") and r.usage_metadata["output_tokens"] >= 1
               for r in replies)


def test_token_id_prompts_in_a_list(client, tiny):
    ids = [tiny.tokenizer.encode(p) for p in PROMPTS[:2]]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in r.choices] == [_alone(tiny, p, max_new_tokens=6) for p in PROMPTS[:2]]


def test_ignore_eos_and_stop_token_ids(client, tiny, server):
    quick = "User: Hello!\nAssistant:"  # greedy, the tiny model ends this at once
    r = client.completions.create(model="tiny", prompt=quick, max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 20
    r = client.completions.create(model="tiny", prompt=quick, max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 20
    r = client.completions.create(model="tiny", prompt=quick, max_tokens=20, temperature=0,
                                  extra_body={"min_tokens": 6})  # EOS held back for six tokens
    assert r.usage.completion_tokens >= 6
    assert r.choices[0].text == _alone(tiny, quick, max_new_tokens=20, min_tokens=6)
    text = _alone(tiny, PROMPTS[0], max_new_tokens=12)
    second = tiny.tokenizer.encode(text, add_bos=False)[1]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                  extra_body={"stop_token_ids": [second]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 2


def test_penalties_as_openai_and_vllm_send_them(client, tiny):
    for prompt, extras in (("Exceptions", {"presence_penalty": 1.5, "frequency_penalty": -0.3}),
                           ("A class definition in Python", {"frequency_penalty": 1.5}),
                           ("The for statement", {"extra_body": {"repetition_penalty": 1.3}})):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, **extras)
        options = extras.get("extra_body", extras)
        assert r.choices[0].text == _alone(tiny, prompt, max_new_tokens=16, **options), extras
        assert r.choices[0].text != _alone(tiny, prompt, max_new_tokens=16)  # (they change these tokens)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Lists hold"}],
                                       max_tokens=8, temperature=0, presence_penalty=0.5)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_unknown_fields_are_ignored_with_one_warning(client, server):
    for _ in range(2):
        r = client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"banana_split": 1})
        assert r.usage.completion_tokens >= 1
    assert server.output().count("ignoring the request field 'banana_split'") == 1, server.output()


def test_tokenize_detokenize_models_and_version(client, server, tiny):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "The for statement"}, timeout=10).json()
    assert r["tokens"] == tiny.tokenizer.encode("The for statement") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == tiny.max_positions
    bare = httpx.post(server.url + "/tokenize", json={"prompt": "x", "add_special_tokens": False}, timeout=10).json()
    assert bare["tokens"] == [ord("x")]
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=10).json()
    assert back == {"prompt": "The for statement"}
    messages = [{"role": "user", "content": "What is a class?"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=10).json()
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert chat["count"] == answer.usage.prompt_tokens
    assert httpx.post(server.url + "/detokenize", json={"tokens": [10**6]}, timeout=10).status_code == 400
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    assert httpx.get(server.url + "/version", timeout=10).json()["version"] == minibatch.__version__


def test_metrics_count_requests_tokens_and_latencies(client, server):
    before = _metrics(server)
    client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    after = _metrics(server)
    done = 'minibatch_requests_total{endpoint="completions",finish_reason="length"}'
    assert after[done] - before.get(done, 0) == 3
    assert after["minibatch_generation_tokens_total"] - before["minibatch_generation_tokens_total"] == 15
    assert after["minibatch_time_to_first_token_seconds_count"] - before["minibatch_time_to_first_token_seconds_count"] == 3
    assert after["minibatch_inter_token_latency_seconds_count"] - before["minibatch_inter_token_latency_seconds_count"] == 12
    assert after["minibatch_kv_blocks"] > 0 and after["minibatch_kv_blocks_used"] == 0 and after["minibatch_running"] == 0


def test_prefix_caching_shares_kv_blocks_of_prompts_that_start_alike(client, server, tiny):
    """Prefix caching, on in `serve` by default: a later prompt with the same start computes only what follows the
    shared full blocks (16 tokens each), and its answer is the one it gets alone."""
    system = "You are a helpful assistant who answers questions about the Python language, briefly. "
    shared = len(tiny.tokenizer.encode(system)) // 16 * 16
    before = _metrics(server)
    for q in ("The for statement", "Exceptions are raised"):
        r = client.completions.create(model="tiny", prompt=system + q, max_tokens=8, temperature=0)
        assert r.choices[0].text == _alone(tiny, system + q, max_new_tokens=8)
    after = _metrics(server)
    hits = after["minibatch_prefix_cache_hit_tokens"] - before["minibatch_prefix_cache_hit_tokens"]
    assert shared >= 64 and hits >= shared  # the second prompt at least; the first may share with earlier ones
    assert after["minibatch_prefix_cache_prompt_tokens"] > before["minibatch_prefix_cache_prompt_tokens"]


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(minibatch_\S+) (\S+)$", text, re.M)}


# --- logprobs and echo ---------------------------------------------------------------------------------

def _reference(tiny, ids: list[int]):
    """log_softmax of the tiny model's logits at every position of `ids`, by Hugging Face's forward."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(tiny.hf(torch.tensor([ids])).logits[0].float(), dim=-1)


ROWS = [("The for statement", " loops"), ("A class definition", " defines a class"), ("Exceptions are", " raised")]


@pytest.mark.parametrize("max_tokens", [1, 0])  # lm-eval's request has 1; older versions and vLLM's docs 0
def test_lm_eval_loglikelihood_requests(server, tiny, max_tokens):
    """lm-eval's local-completions loglikelihood request as it sends it (token ids, echo, logprobs=1), read
    as it reads it: the continuation's logprobs summed, and is_greedy from each token's top logprob."""
    tok = tiny.tokenizer
    contexts = [tok.encode(c) for c, _ in ROWS]
    full = [ctx + tok.encode(cont, add_bos=False) for ctx, (_, cont) in zip(contexts, ROWS)]
    body = {"model": "tiny", "prompt": full, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == len(ROWS)
    for ids, ctx, choice in zip(full, contexts, choices):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens and lp["token_logprobs"][0] is None
        cut = slice(len(ctx), len(ids))  # lm-eval cuts [ctxlen:-1] with one generated token, [ctxlen:] with none
        got = sum(lp["token_logprobs"][cut])
        greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][cut], lp["top_logprobs"][cut]))
        ref = _reference(tiny, ids)
        want = sum(ref[p - 1, ids[p]].item() for p in range(len(ctx), len(ids)))
        assert got == pytest.approx(want, abs=1e-4), (got, want)
        assert greedy == all(ref[p - 1].argmax().item() == ids[p] for p in range(len(ctx), len(ids)))
        assert choice["text"].startswith(tok.decode(ids))  # echo: the prompt, then what was generated
    if max_tokens == 0:
        assert all(c["text"] == tok.decode(ids) for c, ids in zip(choices, full))


def test_logprobs_of_generated_tokens_match_the_model_and_greedy_is_top_1(client, tiny):
    tok = tiny.tokenizer
    prompt = PROMPTS[0]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    new = minibatch.generate(tiny, [tok.encode(prompt)], eos_token_id=tok.eos_token_id, max_new_tokens=8)[0]
    assert lp.tokens == [tok.decode([t]) for t in new]
    ref = _reference(tiny, tok.encode(prompt) + new)
    start = len(tok.encode(prompt)) - 1
    for k, (t, value, top) in enumerate(zip(new, lp.token_logprobs, lp.top_logprobs)):
        assert value == pytest.approx(ref[start + k, t].item(), abs=1e-4)
        assert len(top) <= 3 and max(top.values()) == value  # greedy: the token is the most likely one
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:k]) for k in range(len(lp.tokens))]
    streamed = []
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=3,
                                           stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == lp.token_logprobs
    # sampled tokens too, through chat: each token's logprob and its top alternatives, most likely first
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
                                       temperature=0.9, seed=5, logprobs=True, top_logprobs=4)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(e.top_logprobs) == 4 for e in content)
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and e.logprob <= tops[0] + 1e-6 and e.bytes == list(e.token.encode())
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=6, temperature=0.9, seed=5)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == c.choices[0].message.content


def test_echo_streams_the_prompt_first(client, tiny):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=5, temperature=0, echo=True,
                                            logprobs=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == PROMPTS[1] and first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) == len(tiny.tokenizer.encode(PROMPTS[1]))
    whole = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=5, temperature=0, echo=True,
                                      logprobs=0)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert whole.choices[0].text.startswith(PROMPTS[1])
