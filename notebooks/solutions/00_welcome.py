"""Solution to the exercise of notebook 00."""
import minibatch


def count_until_eos(model, prompt, seed):
    # without eos_token_id, generate does not know which token ends a text and always makes 200
    out = minibatch.generate(model, [prompt], max_new_tokens=200, temperature=0.7, seed=seed,
                             eos_token_id=model.tokenizer.eos_token_id)
    return len(out[0])
