"""load_model: built-in names, a saved folder through the real from_pretrained path, a built model."""

import torch
import transformers

import minibatch


def test_from_pretrained_folder_roundtrip(tmp_path):
    config = transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    hf.save_pretrained(tmp_path)
    model = minibatch.load_model(str(tmp_path), device="cpu")
    assert type(model.hf).__name__ == "Qwen2ForCausalLM"
    prompts = [[5, 6, 7], [8, 9]]
    from_folder = minibatch.generate(model, prompts, max_new_tokens=5)
    from_object = minibatch.generate(minibatch.load_model(hf, device="cpu"), prompts, max_new_tokens=5)
    assert from_folder == from_object


def test_built_in_tiny_has_tokenizer(tiny):
    tok = tiny.tokenizer
    assert tok.decode(tok.encode("café")) == "café"
    out = minibatch.generate(tiny, ["The "], max_new_tokens=3)
    assert len(out) == 1 and len(out[0]) == 3


def test_loaded_model_still_works_with_hf_generate(random_llama):
    out = random_llama.hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
    assert out.shape == (1, 6)


def test_dtype_default_is_float32_on_cpu(random_llama):
    assert random_llama.dtype == torch.float32 and random_llama.device.type == "cpu"
