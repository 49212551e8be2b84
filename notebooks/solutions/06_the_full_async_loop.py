"""Solution to the exercise of notebook 06."""


def compute_gaps(tl):
    spans = sorted((s for s in tl.spans if s.name == "compute"), key=lambda s: s.step)
    return [max(0.0, b.start - a.end) for a, b in zip(spans, spans[1:])]


# On the notebook's timelines, e.g.:
#   gaps = compute_gaps(timelines["sync"]);  print(f"{1e3 * sum(gaps) / len(gaps):.2f} ms per step")
