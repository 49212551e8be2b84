"""Solution to the exercise of notebook 07."""


def busy_fraction(spans):
    spans = sorted(spans)
    total, start, end = 0.0, None, None
    for a, b in spans:
        if end is None or a > end:
            if end is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    total += end - start
    return total / (max(b for _, b in spans) - min(a for a, _ in spans))
