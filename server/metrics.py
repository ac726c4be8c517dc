"""``GET /metrics``: Prometheus text format (prometheus-client), one registry per app.

Counted as requests end: HTTP requests by route and status, prompt and generated tokens, time to first
token, time per output token (decode time / tokens after the first) and request duration; read at
scrape time: jobs running and waiting, requests in flight, KV-cache use and preemptions. Routes that
do not exist are counted under ``route="other"``, so random paths cannot grow the label set.
"""
from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    """The server's Prometheus metrics."""

    def __init__(self, known_routes: set[str]):
        self.known_routes = known_routes
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("trellm_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("trellm_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("trellm_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("trellm_time_to_first_token_seconds", "request start to its first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("trellm_time_per_output_token_seconds", "decode time per generated token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.duration = Histogram("trellm_request_duration_seconds", "generation requests, start to end",
                                  buckets=DURATION_BUCKETS, registry=r)
        self.running = Gauge("trellm_jobs_running", "jobs in the running batch", registry=r)
        self.waiting = Gauge("trellm_jobs_waiting", "jobs waiting for admission (preempted ones included)", registry=r)
        self.in_flight = Gauge("trellm_jobs_in_flight", "jobs of open requests", registry=r)
        self.cache_usage = Gauge("trellm_kv_cache_usage_ratio", "share of KV-cache pages held by jobs (0..1)", registry=r)
        self.preemptions = Gauge("trellm_preemptions", "jobs preempted (recomputed later) since the model loaded",
                                 registry=r)

    def observe_request(self, path: str, status: int) -> None:
        self.requests.labels(route=path if path in self.known_routes else "other", status=str(status)).inc()

    def observe_group(self, group: Any) -> None:
        """A generation request ended: its tokens and times (a JobGroup)."""
        end = time.time()
        self.prompt_tokens.inc(group.prompt_tokens)
        self.generation_tokens.inc(group.completion_tokens)
        self.duration.observe(end - group.t_start)
        if group.t_first_token is not None:
            self.ttft.observe(group.t_first_token - group.t_start)
            if group.completion_tokens > 1:
                self.tpot.observe((end - group.t_first_token) / (group.completion_tokens - 1))

    def render(self, host: Any) -> bytes:
        gen = host.generator
        self.in_flight.set(host.in_flight)
        if gen is not None:
            self.running.set(gen.num_active)
            self.waiting.set(gen.num_pending)
            pages = gen.cache.num_pages
            self.cache_usage.set(1.0 - gen.cache.prefix_cache.available() / pages if pages else 0.0)
            self.preemptions.set(gen.stats.get("preempted", 0))
        return generate_latest(self.registry)


def build_metrics_router(keys) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics", dependencies=[Depends(keys.require_api_key)], tags=["status"],
                response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def metrics(request: Request):
        host = request.app.state.host
        return Response(host.metrics.render(host), media_type=CONTENT_TYPE_LATEST)

    return router
