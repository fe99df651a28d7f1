"""Prometheus metrics of a serving engine: its own registry, fed by iteration stats and request timings."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdec.serving.executor import IterationStats, Load

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class ServingMetrics:
    """``on_step`` (loop thread) and ``observe_request`` (server thread) feed it; ``render`` exposes it.

    Rates (tokens/s, acceptance rate) are over the last ``window_s`` seconds of engine steps.
    """

    def __init__(self, load: Callable[[], Load] | None = None, window_s: float = 10.0) -> None:
        self.registry = reg = CollectorRegistry()
        self.window_s = window_s
        self._window: deque[IterationStats] = deque()
        self._lock = threading.Lock()
        self.queue_length = Gauge("specdec_queue_length", "Requests waiting for admission", registry=reg)
        self.running = Gauge("specdec_running_requests", "Requests admitted and running", registry=reg)
        self.kv_used = Gauge("specdec_kv_blocks_used", "KV blocks allocated (prefix cache included)", registry=reg)
        self.kv_total = Gauge("specdec_kv_blocks_total", "KV blocks in the pool", registry=reg)
        if load is not None:  # read the executor's current load at scrape time
            self.queue_length.set_function(lambda: load().num_waiting)
            self.running.set_function(lambda: load().num_running)
            self.kv_used.set_function(lambda: load().kv_blocks_used)
            self.kv_total.set_function(lambda: load().kv_blocks_total)
        self._live_load = load is not None
        self.batch = Gauge("specdec_batch_size", "Requests in the last engine step", registry=reg)
        self.tokens = Counter("specdec_generation_tokens", "Output tokens committed", registry=reg)
        self.drafted = Counter("specdec_draft_tokens", "Draft tokens proposed", registry=reg)
        self.accepted = Counter("specdec_accepted_draft_tokens", "Draft tokens accepted", registry=reg)
        self.steps = Counter("specdec_engine_steps", "Engine steps", registry=reg)
        self.finished = Counter("specdec_requests_finished", "Finished requests", ["finish_reason"], registry=reg)
        tps = Gauge("specdec_tokens_per_second", "Output tokens per second over the recent window", registry=reg)
        tps.set_function(self.tokens_per_second)
        acc = Gauge("specdec_acceptance_rate", "Accepted / drafted tokens over the recent window", registry=reg)
        acc.set_function(self.acceptance_rate)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram("specdec_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram("specdec_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=reg)

    def on_step(self, s: IterationStats) -> None:
        if not self._live_load:
            self.queue_length.set(s.num_waiting)
            self.running.set(s.num_running)
            self.kv_used.set(s.kv_blocks_used)
            self.kv_total.set(s.kv_blocks_total)
        self.batch.set(s.batch_size)
        self.tokens.inc(s.new_tokens)
        self.drafted.inc(s.drafted)
        self.accepted.inc(s.accepted)
        self.steps.inc()
        with self._lock:
            self._window.append(s)
            self._trim(s.wall_time)

    def _trim(self, now: float) -> None:
        while self._window and self._window[0].wall_time < now - self.window_s:
            self._window.popleft()

    def tokens_per_second(self) -> float:
        with self._lock:
            self._trim(time.time())
            return sum(s.new_tokens for s in self._window) / self.window_s

    def acceptance_rate(self) -> float:
        with self._lock:
            self._trim(time.time())
            drafted = sum(s.drafted for s in self._window)
            return sum(s.accepted for s in self._window) / drafted if drafted else 0.0

    def observe_request(self, finish_reason: str, arrival: float, first_token: float | None, end: float,
                        num_tokens: int) -> None:
        """Timings of one request (``time.perf_counter`` values); latencies only for completed ones."""
        self.finished.labels(finish_reason).inc()
        if finish_reason not in ("stop", "length") or first_token is None:
            return
        self.ttft.observe(first_token - arrival)
        self.e2e.observe(end - arrival)
        if num_tokens > 1:
            self.tpot.observe((end - first_token) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
