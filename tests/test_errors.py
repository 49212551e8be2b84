"""Bad input gets a clear error that names the problem."""

import pytest
import torch

import minibatch


@pytest.mark.parametrize("prompts, kwargs, error, words", [
    ([[]], {}, ValueError, "prompt 0 is empty"),
    ([[1, 2], []], {}, ValueError, "prompt 1 is empty"),
    ([], {}, ValueError, "prompts is empty"),
    ([[1, 99999]], {}, ValueError, "outside the vocabulary"),
    ([[-1]], {}, ValueError, "outside the vocabulary"),
    ([[1, 2]], {"max_new_tokens": 0}, ValueError, "max_new_tokens"),
    ([[1, 2]], {"max_new_tokens": 2.5}, ValueError, "max_new_tokens"),
    ([[1, 2]], {"mode": "fast"}, ValueError, "unknown mode"),
    ([[1] * 100], {"num_blocks": 2, "block_size": 16}, ValueError, "could never run"),
    ([[1] * 500], {"max_new_tokens": 20}, ValueError, "exceed the model's 512 positions"),
    ([[1, 2]], {"temperature": -1.0}, ValueError, "temperature"),
    ([[1, 2]], {"top_p": 0.0}, ValueError, "top_p"),
    ([[1, 2]], {"eos_token_id": 10**6}, ValueError, "eos_token_id"),
    (["hello"], {}, ValueError, "has no tokenizer"),
    ("hello", {}, TypeError, "list of prompts"),
    ([[1, 2]], {"block_size": 0}, ValueError, r"block_size must be an integer in \[1, 512\]"),
    ([[1, 2]], {"max_batch_tokens": 0}, ValueError, "max_batch_tokens must be an integer >= 1"),
    ([[1, 2]], {"max_batch_size": 0}, ValueError, "max_batch_size must be an integer >= 1"),
    ([[1, 2]], {"num_blocks": -1}, ValueError, "num_blocks must be an integer >= 1"),
    ([[1, 2]], {"arrival_steps": [True]}, ValueError, "arrival_steps"),
    ([[1, 2]], {"eos_token_id": "x"}, TypeError, "eos_token_id must be an int"),
    ([[1, 2]], {"eos_token_id": [3, 10**6]}, ValueError, "eos_token_id 1000000"),
    ([["a", "b"]], {}, TypeError, "list of int token ids"),
])
def test_bad_generate_input(random_llama, prompts, kwargs, error, words):
    with pytest.raises(error, match=words):
        minibatch.generate(random_llama, prompts, **kwargs)


@pytest.mark.parametrize("device, words", [("tpu", "unknown device"), ("banana", "unknown device")])
def test_unknown_device(device, words):
    with pytest.raises(ValueError, match=words):
        minibatch.load_model("random-llama", device=device)


def test_cuda_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        minibatch.load_model("random-llama", device="cuda")


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'gpt-17'"):
        minibatch.load_model("gpt-17")


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="could not load model"):
        minibatch.load_model(str(tmp_path / "nothing-here"))


def test_generate_needs_a_loaded_model():
    with pytest.raises(TypeError, match="load_model"):
        minibatch.generate("tiny", [[1, 2]])


def test_several_eos_ids(random_llama):
    free = minibatch.generate(random_llama, [[1, 2, 3]], max_new_tokens=10)[0]
    out = minibatch.generate(random_llama, [[1, 2, 3]], max_new_tokens=10, eos_token_id=[511, free[3]])[0]
    assert out == free[: free.index(free[3]) + 1]
