"""What `GET /metrics` tells a Prometheus server: requests and tokens served, time to first token,
inter-token and end-to-end latency as histograms, and the engine's running and waiting requests and
KV blocks in use, read as the scrape comes (prometheus_client's text format).

Each request is counted as its answer ends (`observe`), from its TokenStream's own timestamps (the
same ones bench-serve's client-side numbers are compared with). One registry per server, so that two
servers in one process (tests) keep their counts apart.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: from a few milliseconds (a decode step on a GPU) to a minute (a long queue)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                   20.48, 60.0)


class Metrics:
    """The server's counters, histograms and gauges; `stats` reads the engine's numbers (Serving.stats)."""

    def __init__(self, stats) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("minibatch_requests", "Choices answered, by endpoint and finish reason",
                                ["endpoint", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("minibatch_prompt_tokens", "Prompt tokens of the choices answered", registry=r)
        self.generation_tokens = Counter("minibatch_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("minibatch_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("minibatch_inter_token_latency_seconds", "Between two tokens of one choice",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("minibatch_e2e_request_latency_seconds", "From arrival to the last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        for name, key, doc in (("running", "running", "Requests in the batch"),
                               ("waiting", "waiting", "Requests waiting for a seat"),
                               ("kv_blocks_used", None, "KV cache blocks held by requests"),
                               ("kv_blocks", "kv_blocks", "KV cache blocks in all"),
                               ("prefix_cache_hit_tokens", "prefix_cache_hit_tokens",
                                "Prompt tokens whose KV came from the prefix cache, not computed (in all)"),
                               ("prefix_cache_prompt_tokens", "prefix_cache_prompt_tokens",
                                "Prompt tokens of the requests admitted (in all)")):
            gauge = Gauge(f"minibatch_{name}", doc, registry=r)
            gauge.set_function(lambda key=key: _read(stats(), key))

    def observe(self, stream, endpoint: str, reason: str | None = None) -> None:
        """One choice's answer has ended: finished (its finish reason), or `reason` (cancelled)."""
        reason = reason or stream.finish_reason or "cancelled"
        self.requests.labels(endpoint, reason).inc()
        self.prompt_tokens.inc(stream.prompt_tokens)
        self.generation_tokens.inc(len(stream.token_ids))
        if stream.ttft is not None:
            self.ttft.observe(stream.ttft)
            self.e2e.observe(stream.token_times[-1] - stream.arrival)
        for gap in stream.itl:
            self.itl.observe(gap)

    def scrape(self) -> tuple[bytes, str]:
        """The text a scrape gets, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _read(stats: dict, key: str | None) -> float:
    if not stats.get("serving"):
        return 0.0
    if key is None:
        return stats["kv_blocks"] - stats["kv_blocks_free"]
    return stats[key]
