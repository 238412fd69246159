"""Prometheus metrics for /metrics, and the access log: both watch every request at the same point.

Counters that come from generations (tokens in and out, cached prompt tokens, load time, tokens per second) are fed
from the final chunk of each answer. Gauges that describe the engines (queue depth, busy slots) are read from
`client.ps()` at scrape time, so the server never reaches into an engine. Each app gets its own registry, so several
apps (tests) can live in one process."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import api
from ..client.protocol import Client

log = logging.getLogger("localllm.server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector(Collector):
    """Per-model gauges read from the client's process list when Prometheus scrapes."""

    def __init__(self, client: Client):
        self._client = client

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        gauges = {
            "queue_depth": GaugeMetricFamily("localllm_queue_depth", "requests waiting for a slot", labels=["model"]),
            "load_waiting": GaugeMetricFamily(
                "localllm_load_waiting",
                "requests for the model waiting for it to reload with their load options",
                labels=["model"],
            ),
            "slots_busy": GaugeMetricFamily("localllm_slots_busy", "slots decoding a request", labels=["model"]),
            "slots_total": GaugeMetricFamily("localllm_slots_total", "slots of the loaded model", labels=["model"]),
            "threads": GaugeMetricFamily(
                "localllm_threads",
                "CPU threads of the model's decode steps now (0: the backend chooses, as MLX does)",
                labels=["model"],
            ),
        }
        ps = self._client.ps()
        rows = ps.models
        for row in rows:
            for name, family in gauges.items():
                family.add_metric([row.name], getattr(row, name))
        draining = GaugeMetricFamily(
            "localllm_model_draining",
            "1 while the model finishes its requests to unload for a waiting request (another model or load options)",
            labels=["model"],
        )
        for row in rows:
            draining.add_metric([row.name], row.status == "draining")
        loaded = GaugeMetricFamily("localllm_models_loaded", "models loaded now")
        loaded.add_metric([], len(rows))
        load_queue = GaugeMetricFamily(
            "localllm_load_queue_depth", "requests waiting for a model to load, reload or make room"
        )
        load_queue.add_metric([], ps.load_queue)
        return [*gauges.values(), draining, loaded, load_queue, *_prefix_cache_families(rows)]


def _prefix_cache_families(rows: list[api.ProcessModel]) -> list[GaugeMetricFamily | CounterMetricFamily]:
    """Prefix-cache figures by tier: requests that reused a prefix, the prompt tokens they skipped, bytes held."""
    hits = CounterMetricFamily(
        "localllm_prefix_cache_hits", "requests that reused a cached prompt prefix, by tier", labels=["model", "tier"]
    )
    tokens = CounterMetricFamily(
        "localllm_prefix_cache_tokens_reused",
        "prompt tokens reused from the prefix cache, by tier",
        labels=["model", "tier"],
    )
    held = GaugeMetricFamily(
        "localllm_prefix_cache_bytes", "bytes of saved prefixes held, by tier", labels=["model", "tier"]
    )
    for row in rows:
        for tier in ("slot", "ram", "disk"):
            hits.add_metric([row.name, tier], row.prefix_cache_hits.get(tier, 0))
            tokens.add_metric([row.name, tier], row.prefix_cache_tokens.get(tier, 0))
        held.add_metric([row.name, "ram"], row.cache_ram_bytes)
        held.add_metric([row.name, "disk"], row.cache_disk_bytes)
    return [hits, tokens, held]


class ServerMetrics:
    def __init__(self, client: Client):
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("localllm_requests", "HTTP requests", ["method", "route", "status"], registry=reg)
        self.duration = Histogram(
            "localllm_request_duration_seconds", "HTTP request time, streaming included", ["route"], registry=reg
        )
        self.tokens_in = Counter(
            "localllm_prompt_tokens",
            "prompt tokens of answered requests, cached ones included",
            ["model"],
            registry=reg,
        )
        self.tokens_out = Counter("localllm_generated_tokens", "tokens generated", ["model"], registry=reg)
        self.cached = Counter(
            "localllm_prompt_cached_tokens", "prompt tokens reused from the prefix cache", ["model"], registry=reg
        )
        self.load_seconds = Histogram(
            "localllm_model_load_seconds",
            "time to load a model",
            ["model"],
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=reg,
        )
        self.tokens_per_second = Histogram(
            "localllm_tokens_per_second",
            "generation speed of one answer",
            ["model"],
            buckets=(1, 5, 10, 20, 50, 100, 200, 500, 1000),
            registry=reg,
        )
        self.spec_tokens = Counter(
            "localllm_spec_tokens",
            "speculative draft tokens: drafted, and accepted by the model",
            ["model", "kind"],
            registry=reg,
        )
        self.spec_seconds = Counter(
            "localllm_spec_seconds",
            "where speculating requests' time went: drafting, the steps verifying drafts, sampling those steps",
            ["model", "phase"],
            registry=reg,
        )
        self.spec_acceptance = Histogram(
            "localllm_spec_acceptance",
            "share of one request's draft tokens the model accepted",
            ["model"],
            buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0),
            registry=reg,
        )
        reg.register(_EngineCollector(client))

    def observe_chunk(self, chunk: api.Timings) -> None:
        """Count one final chunk (non-final chunks carry no totals)."""
        if not getattr(chunk, "done", False):
            return
        model = getattr(chunk, "model", "")
        self.tokens_in.labels(model).inc(chunk.prompt_eval_count)  # the whole prompt, cached part included
        self.tokens_out.labels(model).inc(chunk.eval_count)
        self.cached.labels(model).inc(chunk.prompt_cache_count)
        if chunk.load_duration:
            self.load_seconds.labels(model).observe(chunk.load_duration / 1e9)
        if chunk.eval_count and chunk.eval_duration:
            self.tokens_per_second.labels(model).observe(chunk.eval_count / (chunk.eval_duration / 1e9))
        if chunk.draft_count:
            self._observe_speculation(model, chunk)

    def _observe_speculation(self, model: str, chunk: api.Timings) -> None:
        self.spec_tokens.labels(model, "drafted").inc(chunk.draft_count)
        self.spec_tokens.labels(model, "accepted").inc(chunk.draft_accepted)
        self.spec_acceptance.labels(model).observe(chunk.draft_accepted / chunk.draft_count)
        for phase, ns in (
            ("draft", chunk.draft_duration),
            ("verify", chunk.verify_duration),
            ("sample", chunk.sample_duration),
        ):
            self.spec_seconds.labels(model, phase).inc(ns / 1e9)

    def observe_embed(self, response: api.EmbedResponse) -> None:
        self.tokens_in.labels(response.model).inc(response.prompt_eval_count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class AccessLog:
    """One log line per request (method, path, status, duration) and the request counters. Pure ASGI, so it sees
    the real end of a streamed response."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None
        t0 = time.perf_counter()

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self._record(scope, status, time.perf_counter() - t0)

    def _record(self, scope: Scope, status: int | None, seconds: float) -> None:
        route = getattr(scope.get("route"), "path", "unmatched")
        shown = status if status is not None else "disconnected"
        self.metrics.requests.labels(scope["method"], route, str(shown)).inc()
        self.metrics.duration.labels(route).observe(seconds)
        log.info("%s %s %s %.3fs", scope["method"], scope["path"], shown, seconds)
