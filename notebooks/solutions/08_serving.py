"""Solution to the exercise of notebook 08."""


def latencies(arrival, token_times):
    ttft = token_times[0] - arrival
    itl = [b - a for a, b in zip(token_times, token_times[1:])]
    return ttft, itl


# On the notebook's streams, e.g.:
#   ttft, itl = latencies(streams[0].arrival, streams[0].token_times)
#   print(f"TTFT {1e3 * ttft:.1f} ms, median gap {1e3 * sorted(itl)[len(itl) // 2]:.1f} ms")
