"""Solution to the exercise of notebook 01."""


def ragged_layout(plan):
    positions, logits_indices, offset = [], [], 0
    for c in plan.chunks:
        positions += range(c.start, c.end)  # each token's position within its own request
        offset += c.end - c.start  # where this chunk ends in the flat batch
        if c.sample:
            logits_indices.append(offset - 1)  # its last token produces the new token
    return positions, logits_indices
