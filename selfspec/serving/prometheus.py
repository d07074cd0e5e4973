"""The server's Prometheus metrics (`GET /metrics`), in a registry of its own per application."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..decoding.outputs import SOURCES

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """Requests, tokens, the drafts' acceptance per source, tokens per full pass, time to the first
    token, latency, and the prefix cache of `generator` (read at each scrape; zeros without one)."""

    def __init__(self, generator=None):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("selfspec_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("selfspec_prompt_tokens", "prompt tokens of finished requests",
                                     registry=r)
        self.completion_tokens = Counter("selfspec_completion_tokens",
                                         "generated tokens of finished requests", registry=r)
        self.passes = Counter("selfspec_full_passes", "full-model passes (speculative rounds and plain "
                              "steps), summed over the rows of each wave", registry=r)
        self.drafted = Counter("selfspec_drafted_tokens", "draft tokens verified, by source", ["source"],
                               registry=r)
        self.accepted = Counter("selfspec_accepted_tokens", "draft tokens accepted, by source", ["source"],
                                registry=r)
        self.alpha = Gauge("selfspec_acceptance_rate", "accepted / drafted since start, by source",
                           ["source"], registry=r)
        self.tokens_per_pass = Gauge("selfspec_tokens_per_pass",
                                     "generated tokens per full-model pass since start", registry=r)
        self.queue = Gauge("selfspec_queue_depth", "requests waiting for a wave", registry=r)
        self.wave = Histogram("selfspec_wave_size", "requests decoded together",
                              buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        # every request joins the running batch whatever it asks (its own sampling, seed, schema)
        self.largest_batch = Gauge("selfspec_largest_batch", "the most requests decoded in one round since "
                                   "start", registry=r)
        self.first_token = Histogram("selfspec_time_to_first_token_seconds", "submit to the first token",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("selfspec_request_latency_seconds", "submit to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        def cached(field):
            return lambda: getattr(getattr(generator, "prefix_cache", None), field, 0)

        for field, text in (("hit_tokens", "prompt positions loaded from the prefix cache since start"),
                            ("prefilled_tokens", "prompt positions prefilled through the prefix cache "
                                                 "since start"),
                            ("bytes", "bytes of keys and values the prefix cache holds")):
            Gauge(f"selfspec_prefix_cache_{field}", text, registry=r).set_function(cached(field))
        self._tokens = self._passes = 0  # running sums behind the two ratios
        self._drafted = dict.fromkeys(SOURCES, 0)
        self._accepted = dict.fromkeys(SOURCES, 0)

    def wave_done(self, jobs, stats) -> None:
        """A finished wave: its rows' tokens and passes, and the drafts of each source."""
        self.wave.observe(len(jobs))
        for job in jobs:
            self.prompt_tokens.inc(len(job.prompt))
            self.completion_tokens.inc(len(job.tokens))
            self.passes.inc(job.rounds)
            self._tokens += len(job.tokens)
            self._passes += job.rounds
            if job.first_token is not None:
                self.first_token.observe(job.first_token - job.submitted)
            if job.finished is not None:
                self.latency.observe(job.finished - job.submitted)
        for source in SOURCES:
            part = getattr(stats, source)
            self.drafted.labels(source).inc(part.drafted)
            self.accepted.labels(source).inc(part.accepted)
            self._drafted[source] += part.drafted
            self._accepted[source] += part.accepted
            if self._drafted[source]:
                self.alpha.labels(source).set(self._accepted[source] / self._drafted[source])
        if self._passes:
            self.tokens_per_pass.set(self._tokens / self._passes)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
