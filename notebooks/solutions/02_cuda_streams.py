"""Solution to the exercise of notebook 02."""


def max_concurrency(tl):
    # +1 at a start, -1 at an end; at equal times the end comes first (False sorts before True), so
    # spans that only touch do not count as overlapping
    points = sorted([(s.end, False) for s in tl.spans] + [(s.start, True) for s in tl.spans])
    running = best = 0
    for _, is_start in points:
        running += 1 if is_start else -1
        best = max(best, running)
    return best


# On the notebook's timelines:  max_concurrency(tl_named) == 2,  max_concurrency(tl_default) == 1
