"""Serving benchmark: replay a prompt set against a running OpenAI-compatible server with Poisson
arrivals and a concurrency cap; report TTFT, TPOT and end-to-end latency percentiles and throughput.

Every request streams (server-sent events) and asks for usage in its last event, so output token
counts are the server's own.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

from specdec.errors import FieldError

MAX_SCHEDULE_S = 86400.0  # the longest arrival schedule a request rate may ask for (a day)


@dataclass(frozen=True)
class BenchServeConfig:
    url: str = "http://127.0.0.1:8000"
    dataset: str = "sharegpt"
    num_prompts: int = 100
    request_rate: float = float("inf")
    concurrency: int = 64
    max_tokens: int = 128
    temperature: float = 0.0
    endpoint: str = "chat"
    ignore_eos: bool = False
    seed: int = 0
    label: str | None = None
    api_key: str | None = None  # sent as "Authorization: Bearer <key>" (a server started with --api-key)
    model: str | None = None  # the served model id to ask for (None: the first GET /v1/models lists)
    request_timeout: float = 600.0  # seconds a request may wait for the server's next bytes before it fails

    def __post_init__(self) -> None:
        """FieldError naming the field at fault (the command line maps it to its flag)."""
        def bad(name: str, rule: str) -> FieldError:
            return FieldError("BenchServeConfig", name, rule, getattr(self, name))

        for name in ("num_prompts", "concurrency", "max_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise bad(name, "must be an integer >= 1")
        if not self.request_rate > 0:
            raise bad("request_rate", "must be > 0 (inf = all at once)")
        if (self.num_prompts - 1) / self.request_rate > MAX_SCHEDULE_S:  # (inf: 0)
            raise bad("request_rate", f"must send the {self.num_prompts} requests within {MAX_SCHEDULE_S:.0f} s "
                                      f"(a day), on average; that rate would take "
                                      f"{(self.num_prompts - 1) / self.request_rate:.3g} s")
        if not 0 < self.request_timeout < math.inf:
            raise bad("request_timeout", "must be a finite number of seconds > 0")
        if not 0 <= self.temperature < math.inf:
            raise bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if self.endpoint not in ("chat", "completions"):
            raise bad("endpoint", "must be 'chat' or 'completions'")


@dataclass
class RequestRecord:
    """One request as the client saw it (seconds, ``time.perf_counter`` based)."""

    ok: bool = False
    ttft: float | None = None
    latency: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    mean_accepted_length: float | None = None
    error: str | None = None
    chunk_gaps: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send times of ``n`` requests, Poisson at ``rate`` per second (all at 0 when rate is inf)."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _bodies(cfg: BenchServeConfig, model: str) -> list[dict]:
    from specdec.benchmark.data import load_dataset

    bodies = []
    for p in load_dataset(cfg.dataset, cfg.num_prompts):
        body = {"model": model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        if cfg.endpoint == "chat":
            body["messages"] = p.to_messages()
        else:
            body["prompt"] = p.prompt if p.prompt is not None else p.to_messages()[-1]["content"]
        bodies.append(body)
    return bodies


def _event_text(rec: RequestRecord, line: str, chat: bool) -> str:
    """The text of one ``data: {...}`` event of an OpenAI stream; its usage and error go into ``rec``. ValueError
    naming the line when it is no such event."""
    try:
        obj = json.loads(line[6:])
        if "error" in obj:
            err = obj["error"]
            rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return ""
        if obj.get("usage"):
            u = obj["usage"]
            rec.prompt_tokens, rec.output_tokens = int(u["prompt_tokens"]), int(u["completion_tokens"])
            rec.mean_accepted_length = u.get("mean_accepted_length")
        return "".join((c["delta"].get("content") if chat else c["text"]) or "" for c in obj["choices"])
    except (ValueError, LookupError, TypeError, AttributeError):
        raise ValueError(f"not an OpenAI stream event: {line[:120]!r}") from None


async def _one(client, url: str, body: dict, chat: bool) -> RequestRecord:
    """One streamed request; a request the server refuses, answers with no event stream, ends before ``[DONE]``
    or leaves silent for the client's read timeout is a record with ``error`` set."""
    import httpx

    rec, t0 = RequestRecord(), time.perf_counter()
    last, done = t0, False
    try:
        async with client.stream("POST", url, json=body) as r:
            kind = r.headers.get("content-type", "")
            if r.status_code != 200 or not kind.startswith("text/event-stream"):
                what = f"HTTP {r.status_code}" + (f" ({kind or 'no content-type'}, not an event stream)"
                                                  if r.status_code == 200 else "")
                rec.error = f"{what}: {(await r.aread()).decode(errors='replace')[:200]}"
                return rec
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    break
                if not line.startswith("data: "):
                    continue
                text = _event_text(rec, line, chat)
                if rec.error is not None:
                    return rec
                if text:
                    now = time.perf_counter()
                    if rec.ttft is None:
                        rec.ttft = now - t0
                    else:
                        rec.chunk_gaps.append(now - last)
                    last = now
    except httpx.TimeoutException as err:
        rec.error = f"{type(err).__name__}: nothing from the server for {client.timeout.read:g} s (--request-timeout)"
        return rec
    except Exception as err:  # noqa: BLE001 - a failed request is counted, the benchmark goes on
        rec.error = f"{type(err).__name__}: {err}"
        return rec
    if not done:
        rec.error = "the stream was cut off: it ended without its last event (data: [DONE])"
        return rec
    rec.latency = time.perf_counter() - t0
    rec.ok = rec.ttft is not None or rec.output_tokens == 0
    rec.ttft = rec.ttft if rec.ttft is not None else rec.latency
    return rec


def auth_headers(api_key: str | None) -> dict:
    """The headers that carry ``api_key`` to a server started with ``--api-key`` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _run(cfg: BenchServeConfig) -> tuple[list[RequestRecord], float, str]:
    import httpx

    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    headers = auth_headers(cfg.api_key)
    timeout = httpx.Timeout(cfg.request_timeout, pool=None)  # (the gate below holds requests, not the pool)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        model = cfg.model or (await client.get(f"{cfg.url}/v1/models")).json()["data"][0]["id"]
        bodies = _bodies(cfg, model)
        url = f"{cfg.url}/v1/chat/completions" if cfg.endpoint == "chat" else f"{cfg.url}/v1/completions"
        gate = asyncio.Semaphore(cfg.concurrency)
        start = time.perf_counter()

        async def launch(at: float, body: dict) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with gate:
                return await _one(client, url, body, cfg.endpoint == "chat")

        times = arrival_times(len(bodies), cfg.request_rate, cfg.seed)
        records = await asyncio.gather(*(launch(t, b) for t, b in zip(times, bodies)))
        return list(records), time.perf_counter() - start, model


def percentiles(xs: list[float]) -> dict:
    """mean, p50, p90, p99 (milliseconds) of ``xs`` seconds; empty -> None values."""
    if not xs:
        return {"mean_ms": None, "p50_ms": None, "p90_ms": None, "p99_ms": None}
    s = sorted(xs)

    def q(p: float) -> float:
        k = (len(s) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return 1e3 * (s[lo] + (s[hi] - s[lo]) * (k - lo))

    return {"mean_ms": 1e3 * sum(s) / len(s), "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99)}


def summarize(cfg: BenchServeConfig, records: list[RequestRecord], duration: float, model: str) -> dict:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    mal = [r.mean_accepted_length for r in ok if r.mean_accepted_length]
    return {
        "label": cfg.label, "model": model, "config": asdict(cfg), "completed": len(ok),
        "failed": len(records) - len(ok), "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "mean_output_tokens": out_tokens / len(ok) if ok else 0.0,
        "mean_accepted_length": sum(mal) / len(mal) if mal else None,
        "ttft": percentiles([r.ttft for r in ok]), "tpot": percentiles([t for r in ok if (t := r.tpot)]),
        "e2e_latency": percentiles([r.latency for r in ok]),
    }


def run_bench(cfg: BenchServeConfig) -> dict:
    """Run the benchmark against ``cfg.url`` and return the report (the JSON that ``--json`` writes)."""
    records, duration, model = asyncio.run(_run(cfg))
    return summarize(cfg, records, duration, model)


def print_report(rep: dict) -> None:
    c = rep["config"]
    print(f"== {rep['label'] or 'bench-serve'}: {rep['model']} @ {c['url']}, {c['dataset']}, rate "
          f"{c['request_rate']}/s, concurrency {c['concurrency']}, max_tokens {c['max_tokens']}")
    print(f"completed {rep['completed']}, failed {rep['failed']}, {rep['duration_s']:.1f} s: "
          f"{rep['request_throughput']:.2f} req/s, {rep['output_throughput']:.1f} output tok/s, "
          f"mean accepted length {rep['mean_accepted_length'] or 0:.2f}")
    print(f"{'metric':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}   (ms)")
    for key in ("ttft", "tpot", "e2e_latency"):
        row = rep[key]
        vals = "".join(f"{row[k]:>10.1f}" if row[k] is not None else f"{'-':>10}"
                       for k in ("mean_ms", "p50_ms", "p90_ms", "p99_ms"))
        print(f"{key:<12}{vals}")
    for err in rep["errors"]:
        print(f"error: {err}")
