"""Solution to the exercise of notebook 00."""
import minibatch


def count_until_eos(model, prompt):
    out = minibatch.generate(model, [prompt], max_new_tokens=200, eos_token_id=model.tokenizer.eos_token_id)
    return len(out[0])
