"""Solution to the exercise of notebook 05."""

import torch


def scatter_carry_over(input_ids, prev_output, mask):
    n = input_ids.shape[0]
    dest = torch.where(mask >= 0, mask, n)  # rows that go nowhere land on a scratch position past the end
    padded = torch.cat([input_ids, input_ids.new_zeros(1)])
    return padded.scatter(0, dest, prev_output[: mask.shape[0]])[:n]  # scatter returns a new tensor
