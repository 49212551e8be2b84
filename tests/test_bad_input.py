"""Every bad input gets the package's clear error, naming the argument, before any device work; none hangs.

The cases are the ones an adversarial pass over the API found accepted, silently changed or failing
deep inside the run, plus neighbours of each. `no_device_work` makes opening a device or allocating a
KV cache fail the test, so a passing case proves the check came first.
"""

import builtins
import json
import math
import re
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
import transformers

import minibatch
from minibatch.core import engine
from minibatch.core import memory
from minibatch.model.model import Model

GB = 10**9


@pytest.fixture
def no_device_work(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("device work started before the arguments were checked")

    monkeypatch.setattr(engine, "open_device", refuse)
    monkeypatch.setattr(Model, "make_cache", refuse)
    # the same free memory on every machine, so the memory cases do not depend on where the tests run
    monkeypatch.setattr(memory, "available_bytes", lambda device: (8 * GB, 8 * GB))


def gen_ids():  # a generator, not a sequence
    yield 0


GENERATE_CASES = [
    # (kwargs, error, words naming the argument)
    (dict(mode="async", num_slots=1), ValueError, "allow_races=True"),
    (dict(mode="async", num_slots=1, allow_races="yes"), TypeError, "allow_races"),
    (dict(top_k=2.5), ValueError, "top_k must be an integer"),
    (dict(top_k=math.nan), ValueError, "top_k must be an integer"),
    (dict(top_k=True), ValueError, "top_k must be an integer"),
    (dict(top_k=-1), ValueError, "top_k must be an integer >= 0"),
    (dict(seed=1.5), ValueError, "seed must be an integer"),
    (dict(seed=2**70), ValueError, "seed must be an integer in"),
    (dict(seed=2**63 - 1), ValueError, "seed must be an integer in"),  # request 1 samples with seed + 1
    (dict(seed=-1), ValueError, "seed must be an integer in"),
    (dict(seed="a"), ValueError, "seed must be an integer"),
    (dict(num_slots=True), ValueError, "num_slots must be an integer"),
    (dict(num_slots=2.0), ValueError, "num_slots must be an integer"),
    (dict(num_slots=3), ValueError, "num_slots must be an integer in"),
    (dict(num_slots=0), ValueError, "num_slots must be an integer in"),
    (dict(temperature=math.inf), ValueError, "temperature must be a finite number"),
    (dict(temperature=-math.inf), ValueError, "temperature must be a finite number"),
    (dict(temperature=math.nan), ValueError, "temperature must be a finite number"),
    (dict(temperature="0.5"), ValueError, "temperature must be a finite number"),
    (dict(temperature=True), ValueError, "temperature must be a finite number"),
    (dict(temperature=-0.5), ValueError, "temperature must be a finite number >= 0"),
    (dict(top_p="x"), ValueError, "top_p must be a finite number"),
    (dict(top_p=math.nan), ValueError, "top_p must be a finite number"),
    (dict(top_p=1.5), ValueError, r"top_p must be a finite number in \(0, 1\]"),
    (dict(max_new_tokens=None), ValueError, "max_new_tokens must be an integer"),
    (dict(max_new_tokens=True), ValueError, "max_new_tokens must be an integer"),
    (dict(max_new_tokens=2.0), ValueError, "max_new_tokens must be an integer"),
    (dict(max_batch_tokens=None), ValueError, "max_batch_tokens must be an integer"),
    (dict(max_batch_size=2.0), ValueError, "max_batch_size must be an integer"),
    (dict(block_size=None), ValueError, "block_size must be an integer"),
    (dict(num_blocks=True), ValueError, "num_blocks must be an integer"),
    (dict(num_blocks=1, block_size=1), ValueError, "could never run"),
    (dict(inject_delays=["H2D"]), TypeError, "inject_delays must be a dict"),
    (dict(inject_delays={"GPU": 1.0}), ValueError, "inject_delays keys"),
    (dict(inject_delays={"compute": math.inf}), ValueError, r"inject_delays\['compute'\] must be a finite number"),
    (dict(inject_delays={"H2D": math.nan}), ValueError, r"inject_delays\['H2D'\] must be a finite number"),
    (dict(inject_delays={"D2H": -1}), ValueError, r"inject_delays\['D2H'\] must be a finite number of seconds >= 0"),
    (dict(inject_delays={"H2D": "0.1"}), ValueError, r"inject_delays\['H2D'\] must be a finite number"),
    (dict(timeline="x"), TypeError, "timeline must be a minibatch.Timeline"),
    (dict(timeout="5"), ValueError, "timeout must be a finite number"),
    (dict(timeout=math.nan), ValueError, "timeout must be a finite number"),
    (dict(timeout=-math.inf), ValueError, "timeout must be a finite number"),
    (dict(timeout=0), ValueError, "timeout must be a finite number of seconds > 0"),
    (dict(timeout=True), ValueError, "timeout must be a finite number"),
    (dict(arrival_steps=0), ValueError, "arrival_steps needs one integer"),
    (dict(arrival_steps=gen_ids()), ValueError, "arrival_steps needs one integer"),
    (dict(arrival_steps=[0, 0, 0]), ValueError, "arrival_steps needs one integer"),
    (dict(arrival_steps="0"), ValueError, "arrival_steps needs one integer"),
    (dict(arrival_steps=[0, 1.0]), ValueError, r"arrival_steps\[1\] must be an integer"),
    (dict(arrival_steps=[-1, 0]), ValueError, r"arrival_steps\[0\] must be an integer >= 0"),
    (dict(on_step=5), TypeError, "on_step must be a function"),
    (dict(progress="no"), TypeError, "progress must be True or False"),
    (dict(cuda_graphs="on"), TypeError, "cuda_graphs must be True, False, \"decode\" or None"),
    (dict(compile=1), TypeError, "compile must be True, False or \"dynamic\""),
    (dict(compile="dynamc"), TypeError, "compile must be True, False or \"dynamic\", got .dynamc."),
    (dict(mode=None), ValueError, "unknown mode"),
    (dict(eos_token_id=1.5), TypeError, "eos_token_id must be an int"),
    (dict(eos_token_id=True), TypeError, "eos_token_id must be an int"),
    # sizes that cannot fit: refused with the number before anything is allocated
    (dict(max_batch_tokens=10**9), ValueError, "needs about .* GB of host memory.*Lower max_batch_tokens"),
    (dict(num_blocks=10**7), ValueError, "needs about .* GB of host memory.*Lower num_blocks or block_size"),
    (dict(num_blocks=10**9), ValueError, "needs about .* GB of host memory.*Lower num_blocks or block_size"),
    (dict(block_size=10**7), ValueError, r"block_size must be an integer in \[1, 512\]"),
    (dict(max_batch_size=10**8, max_batch_tokens=10**8), ValueError, "Lower max_batch_tokens or max_batch_size"),
]
GENERATE_CASES.append((dict(cuda_graphs=True), ValueError, "cuda_graphs=True needs a CUDA model"))  # a CPU model
GENERATE_CASES.append((dict(compile="dynamic"), ValueError, "compile='dynamic' is for CUDA models"))


@pytest.mark.parametrize("kwargs, error, words", GENERATE_CASES, ids=lambda x: repr(x)[:40])
def test_bad_generate_argument(random_llama, no_device_work, kwargs, error, words):
    with pytest.raises(error, match=words):
        minibatch.generate(random_llama, [[1, 2, 3], [4, 5]], **{"max_new_tokens": 4, **kwargs})


@pytest.mark.parametrize("prompts, error, words", [
    ([b"abc"], TypeError, "prompt 0 is bytes"),
    ([[1, 2], bytearray(b"ab")], TypeError, "prompt 1 is bytearray"),
    (b"abc", TypeError, "prompts must be a list"),
    ((p for p in [[1, 2]]), TypeError, "prompts must be a list"),
    ([[1.0, 2.0]], TypeError, "list of int token ids"),
    ([[True, 2]], TypeError, "list of int token ids"),
    ([torch.tensor([1.5, 2.0])], TypeError, "list of int token ids"),
    ([torch.tensor([[1, 2]])], TypeError, "list of int token ids"),
    ([[1, 2]] * 2 + [[2**64]], ValueError, "prompt 2 has token id"),
], ids=lambda x: repr(x)[:30])
def test_bad_prompts(random_llama, no_device_work, prompts, error, words):
    with pytest.raises(error, match=words):
        minibatch.generate(random_llama, prompts, max_new_tokens=4)


def test_lone_surrogate_in_a_string_prompt(tiny, no_device_work):
    with pytest.raises(ValueError, match="prompt 1 cannot be encoded as UTF-8 text"):
        minibatch.generate(tiny, ["fine", "bad \ud800 text"], max_new_tokens=4)


def test_sizes_beyond_any_machine_are_refused_on_this_one(random_llama, monkeypatch):
    """No patched memory figure: 8 TB of KV cache fits nowhere, and is refused before allocating."""
    monkeypatch.setattr(engine, "open_device", lambda *a, **k: pytest.fail("device opened"))
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"needs about \d+\.\d GB .*KV cache .*num_blocks=1000000000"):
        minibatch.generate(random_llama, [[1, 2, 3]], max_new_tokens=4, num_blocks=10**9)
    assert time.perf_counter() - t < 5


def test_memory_estimate_matches_what_is_allocated(random_llama):
    """The KV term is the cache a run builds, byte for byte; the IO term bounds an IO slot's buffers closely."""
    from minibatch.devices import get_device
    from minibatch.core.slots import IOSlot

    est = memory.estimate_bytes(random_llama, 7, 32, 128, 8, 16, num_slots=1)
    assert est["kv"] == random_llama.make_cache(7, 16).nbytes
    with get_device("cpu") as dev:
        slot = IOSlot(dev, 0, 32, 128, 8)
        real = sum(t.nbytes for t in [*slot.host.values(), *slot.dev.values(), slot.out_host, slot.out_dev])
    assert real <= est["io_host"] + est["io_dev"] <= 1.1 * real


def test_documented_edge_values(random_llama):
    """inf timeout = no limit; top_k past the vocabulary = no filter; numpy integers are integers."""
    work = [[5, 6, 7], [8, 9]]
    kw = dict(max_new_tokens=5, temperature=1.0, seed=4)
    ref = minibatch.generate(random_llama, work, **kw)
    assert minibatch.generate(random_llama, work, timeout=math.inf, **kw) == ref
    assert minibatch.generate(random_llama, work, top_k=10**30, **kw) == ref
    assert minibatch.generate(random_llama, work, top_k=random_llama.vocab_size, **kw) == ref
    assert minibatch.generate(random_llama, work, **{**kw, "seed": np.int64(4), "max_new_tokens": np.int32(5)}) == ref
    assert minibatch.generate(random_llama, [[np.int64(5), 6, 7], torch.tensor([8, 9])], **kw) == ref
    top = minibatch.generate(random_llama, work, mode="async", top_k=1, **kw)
    assert top == minibatch.generate(random_llama, work, max_new_tokens=5)  # top_k=1 is greedy


# --- load_model --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, words", [
    (dict(dtype="banana"), ValueError, "dtype must be one of"),
    (dict(dtype=torch.int8), ValueError, "dtype must be one of"),
    (dict(dtype=float), ValueError, "dtype must be one of"),
    (dict(seed="x"), ValueError, "seed must be an integer"),
    (dict(seed=1.5), ValueError, "seed must be an integer"),
    (dict(seed=-1), ValueError, "seed must be an integer in"),
    (dict(seed=2**70), ValueError, "seed must be an integer in"),
    (dict(device=5), TypeError, "device must be a string"),
    (dict(device="tpu"), ValueError, "unknown device 'tpu'"),
    (dict(device="cpu:x"), ValueError, "unknown device 'cpu:x'"),
], ids=lambda x: repr(x)[:30])
def test_bad_load_model_argument(kwargs, error, words, monkeypatch):
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(error, match=words):
        minibatch.load_model("random-llama", **{"device": "cpu", **kwargs})


def test_device_and_dtype_are_normalized_at_load_time():
    model = minibatch.load_model("random-llama", device="cpu:0", dtype="float32")
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert len(minibatch.generate(model, [[1, 2]], max_new_tokens=3)[0]) == 3


def tiny_config(cls=transformers.BertConfig):
    return cls(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)


def test_a_model_without_a_causal_lm_head_is_refused():
    with pytest.raises(ValueError, match="BertModel, which is not a decoder-only causal LM"):
        minibatch.load_model(transformers.BertModel(tiny_config()), device="cpu")
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=64, d_model=16, num_layers=1,
                                                                       num_heads=2, d_ff=32, d_kv=8))
    with pytest.raises(ValueError, match="T5ForConditionalGeneration, which is not a decoder-only causal LM"):
        minibatch.load_model(t5, device="cpu")


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory):
    """A real tiny model folder, saved by transformers."""
    path = tmp_path_factory.mktemp("good")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def hostile(good, tmp_path, change):
    import shutil

    path = tmp_path / "model"
    shutil.copytree(good, path)
    change(path)
    return path


def write(name, content):
    return lambda p: (p / name).write_bytes(content) if isinstance(content, bytes) else (p / name).write_text(content)


EVIL = "open({marker!r}, 'w').write('ran')\nfrom transformers import PretrainedConfig\n" \
       "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"


def custom_code(marker, model_type="evil"):
    def change(path):
        config = json.loads((path / "config.json").read_text())
        config.update(model_type=model_type, auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                                       "AutoModelForCausalLM": "modeling_evil.EvilModel"})
        (path / "config.json").write_text(json.dumps(config))
        for name in ("configuration_evil.py", "modeling_evil.py"):
            (path / name).write_text(EVIL.format(marker=str(marker)))
    return change


@pytest.mark.parametrize("change, words", [
    (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:100]),
     "SafetensorError"),
    (write("model.safetensors", b""), "SafetensorError"),
    (write("model.safetensors", bytes(range(256)) * 20), "SafetensorError"),
    (lambda p: (p / "model.safetensors").unlink(), "no file named model.safetensors"),
    (write("config.json", "{not json"), "not a valid JSON file"),
    (write("config.json", "{}"), "model_type"),
    (lambda p: (p / "config.json").unlink(), "the folder has no config.json"),
    (lambda p: transformers.BertModel(tiny_config()).save_pretrained(p), "no weights for"),
], ids=["truncated", "empty", "garbage", "no-weights", "bad-json", "no-model-type", "no-config", "bert-no-head"])
def test_broken_model_folder(good_folder, tmp_path, change, words):
    path = hostile(good_folder, tmp_path, change)
    with pytest.raises(ValueError, match=f"could not load model '{path}'.*{words}"):
        minibatch.load_model(str(path), device="cpu")


def test_the_path_of_config_json_itself(good_folder):
    with pytest.raises(ValueError, match="config.json.*is a file; give the folder"):
        minibatch.load_model(str(good_folder / "config.json"), device="cpu")


def test_a_folder_with_custom_code_is_refused_without_running_it(good_folder, tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    path = hostile(good_folder, tmp_path, custom_code(marker))
    monkeypatch.setattr(builtins, "input", lambda *a: pytest.fail("asked on stdin"))
    with pytest.raises(ValueError, match="contains custom code"):
        minibatch.load_model(str(path), device="cpu")
    assert not marker.exists()
    # the same in a fresh process whose stdin answers "y": still refused, nothing run, no wait
    code = f"import minibatch; minibatch.load_model({str(path)!r}, device='cpu')"
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], input="y\ny\n", capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "contains custom code" in r.stderr and not marker.exists()
    assert time.perf_counter() - t < 60  # transformers' own prompt would wait 15 s per question


def test_custom_code_beside_a_known_architecture_is_never_run(good_folder, tmp_path, monkeypatch):
    """auto_map in a Llama folder, and a custom tokenizer: the built-in classes load, the folder's code never runs."""
    marker = tmp_path / "marker"
    path = hostile(good_folder, tmp_path, custom_code(marker, model_type="llama"))
    tokenizer_map = {"auto_map": {"AutoTokenizer": ["tokenization_evil.T", None]}}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_map))
    (path / "tokenization_evil.py").write_text(EVIL.format(marker=str(marker)))
    monkeypatch.setattr(builtins, "input", lambda *a: pytest.fail("asked on stdin"))
    model = minibatch.load_model(str(path), device="cpu")
    assert type(model.hf).__name__ == "LlamaForCausalLM" and model.tokenizer is None
    assert not marker.exists()


# --- the command line --------------------------------------------------------------------------------

def cli(*args):
    """A fresh process, stdin closed: what a user sees."""
    return subprocess.run([sys.executable, "-m", "minibatch", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)


def one_error_line(returncode, stderr, words):
    assert returncode == 2, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith("error: ") and re.search(words, stderr), stderr


CLI_CASES = [
    (["bench", "--num-prompts", "-1"], "argument --num-prompts: must be an integer >= 1"),
    (["bench", "--prompt-len", "-3"], "argument --prompt-len: must be an integer >= 1"),
    (["bench", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1"),
    (["bench", "--max-batch-tokens", "x"], "argument --max-batch-tokens: must be an integer >= 1"),
    (["bench", "--seed", "99999999999999999999999"], "argument --seed: must be an integer >= 0"),
    (["bench", "--hf-memory", "nan"], r"argument --hf-memory: must be a number in \(0, 1\]"),
    (["bench", "--hf", "sync_turbo"], r"argument --hf: --hf takes 'default', 'all' or some of sync_eager"),
    (["demo", "--temperature", "inf"], "argument --temperature: must be a number"),
    (["demo", "--modes", "turbo"], "argument --modes: unknown mode 'turbo'"),
    (["demo", "--out", "/dev/null/x"], "--out '/dev/null/x' cannot be written"),
    (["bench", "--out", "/dev/null/x", "--device", "cpu"], "--out '/dev/null/x' cannot be written"),
    (["bench", "--device", "tpu"], "unknown device 'tpu'"),
    (["bench", "--hf-memory", "0.5"], "--hf-memory sizes the KV cache of transformers' chosen modes: it needs --hf MODES"),
    (["bench", "--hf", "--hf-memory", "0.5"], "it needs --hf MODES"),
    # (--port 0: the port is bound before the model loads, and any free one will do)
    (["serve", "--port", "0", "--device", "cpu", "--cuda-graphs", "decode"],
     "cuda_graphs='decode' needs a CUDA model; this model is on cpu"),
    (["serve", "--port", "0", "--device", "cpu", "--compile"], "compile=True is for CUDA models; this model is on cpu"),
    (["serve", "--port", "0", "--device", "cpu", "--capture-up-to", "512"],
     "--capture-up-to captures CUDA graphs: it needs a CUDA device"),
    (["serve", "--port", "0", "--capture-up-to", "-1"], "argument --capture-up-to: must be an integer >= 0"),
    (["serve", "--port", "0", "--device", "cpu", "--max-batch-size", "64", "--max-batch-tokens", "32"],
     r"max_batch_tokens \(32\) must be >= max_batch_size \(64\)"),
    (["bench", "--model", "random-llama", "--device", "cpu", "--max-batch-tokens", str(10**11),
      "--max-batch-size", str(10**11)], "Lower max_batch_tokens"),
]


@pytest.mark.parametrize("args, words", CLI_CASES, ids=lambda x: " ".join(x)[:40] if isinstance(x, list) else None)
def test_cli_user_errors_are_one_line(args, words, capsys, no_device_work):
    """In this process (a fresh one per case would spend seconds importing torch): exit 2, one line."""
    from minibatch.tools.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    one_error_line(e.value.code, capsys.readouterr().err, words)


@pytest.mark.parametrize("case", [0, 8], ids=["bad-option", "bad-out"])
def test_cli_user_errors_in_a_fresh_process(case):
    args, words = CLI_CASES[case]
    r = cli(*args)
    one_error_line(r.returncode, r.stderr, words)


def test_cli_broken_model_folder_is_one_line(good_folder, tmp_path):
    path = hostile(good_folder, tmp_path, write("model.safetensors", b"garbage"))
    r = cli("bench", "--model", str(path), "--device", "cpu", "--no-progress")
    one_error_line(r.returncode, r.stderr, f"error: could not load model '{path}': SafetensorError")


# --- hostile folders, limits of the machine ------------------------------------------------------------

def set_config(**changes):
    def change(path):
        config = json.loads((path / "config.json").read_text())
        config.update(changes)
        (path / "config.json").write_text(json.dumps(config))
    return change


def test_a_config_too_large_for_memory_is_refused_before_allocating(good_folder, tmp_path):
    path = hostile(good_folder, tmp_path, set_config(num_hidden_layers=10**7))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"could not load model .*10000000 layers.* GB .* GB are free"):
        minibatch.load_model(str(path), device="cpu")
    assert time.monotonic() - t0 < 20


def test_a_model_with_a_short_context_generates_with_the_default_block_size(good_folder, tmp_path):
    path = hostile(good_folder, tmp_path, set_config(max_position_embeddings=8))
    model = minibatch.load_model(str(path), device="cpu")
    assert len(minibatch.generate(model, [[1, 2, 3]], max_new_tokens=4)[0]) == 4
    with pytest.raises(ValueError, match=r"block_size .*got 9.*max_position_embeddings=8"):
        minibatch.generate(model, [[1, 2, 3]], max_new_tokens=4, block_size=9)


def test_an_index_naming_a_shard_outside_the_folder_is_refused(good_folder, tmp_path):
    import shutil

    def change(path):
        shutil.copy(path / "model.safetensors", tmp_path / "outside.safetensors")
        (path / "model.safetensors").rename(path / "inside.safetensors")
        names = json.loads((path / "config.json").read_text())  # any key: the refusal comes first
        index = {"metadata": {}, "weight_map": {"lm_head.weight": "inside.safetensors",
                                                "model.norm.weight": "../outside.safetensors"}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        assert names
    path = hostile(good_folder, tmp_path, change)
    with pytest.raises(ValueError, match=r"names the shard '\.\./outside\.safetensors', outside the folder"):
        minibatch.load_model(str(path), device="cpu")


def test_a_missing_path_or_a_symlink_loop_is_no_such_folder(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for path in (str(tmp_path / "absent" / "model"), str(loop), "./absent"):
        with pytest.raises(ValueError, match="no such folder"):
            minibatch.load_model(path, device="cpu")


def test_nan_weights_are_reported(good_folder, tmp_path):
    def change(path):
        hf = transformers.AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            for p in hf.parameters():
                p.fill_(float("nan"))
        hf.save_pretrained(path)
    path = hostile(good_folder, tmp_path, change)
    with pytest.warns(UserWarning, match="NaN or infinite weights"):
        minibatch.load_model(str(path), device="cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_single_bad_weight_anywhere_is_reported(dtype, value):
    """The check reads every element of every CPU weight, the last one of a large weight included."""
    from minibatch.model.checks import check_finite

    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64)).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_finite(hf, "clean")  # nothing to say: finite throughout, large values included
        with torch.no_grad():
            hf.model.layers[0].mlp.up_proj.weight.fill_(-65504.0)
        check_finite(hf, "clean")
    weight = hf.model.layers[0].mlp.up_proj.weight  # 262,144 elements: past any sampled prefix
    with torch.no_grad():
        weight.view(-1)[-1] = value
    with pytest.warns(UserWarning, match=r"NaN or infinite weights in model\.layers\.0\.mlp\.up_proj\.weight"):
        check_finite(hf, "broken")
    from minibatch.model.checks import _host_finite

    assert not _host_finite(weight.t()) and not _host_finite(weight[:, -1:])  # views, strided: read too
    assert _host_finite(weight[:, :-1]) and _host_finite(weight[:0])


UNDER_LIMIT = """
import os, resource, sys, glob
import minibatch
from minibatch.devices import get_device
model = minibatch.load_model("tiny")
with open("/proc/self/status") as f:
    used = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (used + 600 * 2**20, resource.RLIM_INFINITY))
try:
    minibatch.generate(model, [[1, 2, 3]], max_new_tokens=2, num_blocks=200000)
except ValueError as e:
    print("check:", e)
before = set(glob.glob(f"/dev/shm/torch_{os.getpid()}_*"))
dev = get_device("cpu")
try:
    dev.empty((10**8,), dtype=__import__("torch").float32)  # fits once, not twice: the shared copy fails
except ValueError as e:
    print("alloc:", e)
print("left:", sorted(set(glob.glob(f"/dev/shm/torch_{os.getpid()}_*")) - before))
dev.close()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /dev/shm as on Linux")
def test_an_address_space_limit_is_a_clear_error_and_leaves_nothing_in_dev_shm():
    r = subprocess.run([sys.executable, "-c", UNDER_LIMIT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert re.search(r"check: this run needs about .* GB of host memory.*Lower num_blocks", r.stdout), r.stdout
    assert re.search(r"alloc: the cpu device could not allocate 0\.40 GB of shared memory.*Lower num_blocks",
                     r.stdout), r.stdout + r.stderr
    assert "left: []" in r.stdout, r.stdout
