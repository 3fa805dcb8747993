"""The frontend's Prometheus metrics (`GET /metrics`): what a vLLM or SGLang operator scrapes from the API server.

Why the frontend has its own: tritonserver's metrics port sees turns, not HTTP requests. What only the frontend
knows is here: requests by route and status, errors by OpenAI type and code, prompt / completion / cached tokens as
the `usage` field reports them, time to first token and inter-token latency as the client sees them (HTTP parsing,
the prefix cache and the gRPC hop included), how often a resent conversation continued its server session, and how
often the server refused the session token the frontend holds for a cached session (path="openai", beside the
server's own `mol2_session_token_refusals{path="turn"|"cancel"}`) and the session was rebuilt instead.
One registry per app, so two apps in one process (tests) never share counts.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _SessionCounts:
    """The chat service's own counts of refused session tokens and rebuilt sessions, read at each scrape (the service
    counts them where they happen, including a refusal whose rebuild then failed)."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self.counts = counts

    def collect(self):  # type: ignore[no-untyped-def]
        counts = self.counts()
        refusals = CounterMetricFamily("mol2_frontend_session_token_refusals",
                                       "continuing turns the server refused for the session token the frontend sent "
                                       "(the cached session is rebuilt), by path",
                                       labels=["path"])
        refusals.add_metric(["openai"], counts.get("refusals", 0))
        yield refusals
        rebuilds = CounterMetricFamily("mol2_frontend_session_rebuilds",
                                       "cached sessions rebuilt from the messages under a new session id, by reason: "
                                       "token_refused (the server refused the session's token), session_lost (the "
                                       "server had evicted or ended it)", labels=["reason"])
        rebuilds.add_metric(["token_refused"], counts.get("rebuilt_after_refusal", 0))
        rebuilds.add_metric(["session_lost"], counts.get("rebuilt_after_loss", 0))
        yield rebuilds


class FrontendMetrics:
    def __init__(self, session_counts: Callable[[], dict[str, int]] | None = None) -> None:
        """`session_counts`: the chat service's refusal and rebuild counts (`ChatService.session_counts`)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mol2_frontend_requests", "HTTP requests answered, by route template and status code",
                                ["route", "status"], registry=r)
        self.errors = Counter("mol2_frontend_errors", "OpenAI-format errors returned (before or during a stream), by "
                                                      "type and code", ["type", "code"], registry=r)
        self.prompt_tokens = Counter("mol2_frontend_prompt_tokens",
                                     "prompt tokens of completed chat completions (usage)",
                                     registry=r)
        self.cached_tokens = Counter("mol2_frontend_cached_tokens",
                                     "prompt tokens a continued server session already held",
                                     registry=r)
        self.completion_tokens = Counter("mol2_frontend_completion_tokens",
                                         "generated tokens of completed chat completions",
                                         registry=r)
        self.sessions = Counter("mol2_frontend_sessions", "how each chat completion found its server session: reused "
                                "(continued, only the new message encoded), rebuilt (history re-encoded), new",
                                ["outcome"], registry=r)
        self.ttft = Histogram("mol2_frontend_time_to_first_token_seconds",
                              "request received to the first generated token (streamed or not)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mol2_frontend_inter_token_latency_seconds", "mean gap between generated tokens, one "
                             "observation per completion of two or more tokens", buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram("mol2_frontend_request_duration_seconds",
                                  "chat completion, request received to the last byte produced",
                                  buckets=LATENCY_BUCKETS, registry=r)
        for outcome in ("reused", "rebuilt", "new"):
            self.sessions.labels(outcome)  # exported from zero, so a rate() has a first sample
        if session_counts is not None:
            r.register(_SessionCounts(session_counts))

    def completed(self, prompt: int, cached: int, completion: int, received: float, first: float, done: float) -> None:
        """One finished chat completion (times from `time.perf_counter`)."""
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.completion_tokens.inc(completion)
        self.duration.observe(done - received)
        if completion >= 2:
            self.itl.observe((done - first) / (completion - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
