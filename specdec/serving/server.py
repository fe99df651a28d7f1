"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over an Executor, with Prometheus /metrics.

Endpoints: POST /v1/completions, POST /v1/chat/completions (JSON or server-sent events), GET /v1/models, GET
/v1/models/{model}, GET|HEAD /health, GET /metrics, and vLLM's POST /tokenize, POST /detokenize and GET /version;
every error, a routing one (404, 405) too, is an OpenAI error body. A completions ``prompt`` may hold several
prompts (vLLM's batch): each runs as its own requests. A client that disconnects cancels its requests, which frees
their KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

import specdec
from specdec.outputs import RequestOutput
from specdec.sampling_params import SamplingParams, sample_requests
from specdec.serving import protocol
from specdec.serving.data_parallel import DataParallelExecutor
from specdec.serving.executor import Executor
from specdec.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)
_DISCONNECT_POLL_S = 0.25
# the largest request body read (``--max-request-bytes``): far above any prompt the served models hold (1 MiB of
# text is about 250k tokens), so only a hostile body is refused, before it is parsed or tokenised
DEFAULT_MAX_REQUEST_BYTES = 2 << 20
OPEN_PATHS = ("/health", "/metrics", "/version")  # answered without the API key: probes, scrapers


class _ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


def build_app(executor: Executor | DataParallelExecutor, model_name: str, default_chat_max_tokens: int = 256,
              metrics: ServingMetrics | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving ``executor``'s engine (or data-parallel replicas) under the name
    ``model_name``. A body over ``max_request_bytes`` is refused (413) before it is parsed; prompts are tokenised off
    the engine's loop. With ``api_key``, every request but those of ``OPEN_PATHS`` (probes, scrapers) must carry
    ``Authorization: Bearer <api_key>`` (else 401, as vLLM's ``--api-key``, which also guards /tokenize here)."""
    if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be an int >= 1, got {max_request_bytes!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty string or None")
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None)
    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def require_key(request: Request, call_next):
            given = request.headers.get("authorization", "").encode()
            if request.url.path not in OPEN_PATHS and not hmac.compare_digest(given, expected):
                return _error(protocol.BadRequest(None, "missing or wrong API key: send 'Authorization: Bearer "
                                                        "<key>' with the key the server was started with", 401))
            return await call_next(request)

    metrics = metrics or ServingMetrics(lambda: executor.load)
    executor.add_stats_listener(metrics.on_step)
    app.state.executor, app.state.metrics, app.state.model_name = executor, metrics, model_name
    created = int(time.time())
    card = {"id": model_name, "object": "model", "created": created, "owned_by": "specdec"}

    @app.exception_handler(HTTPException)
    async def routing_error(request: Request, err: HTTPException) -> Response:
        """Starlette's own errors (no such path, a method the path does not take) in OpenAI's error shape."""
        return JSONResponse(protocol.error_body(f"{err.detail}: {request.method} {request.url.path}", None,
                                                err.status_code), status_code=err.status_code, headers=err.headers)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        replicas = {"replicas": executor.status()} if isinstance(executor, DataParallelExecutor) else {}
        if not executor.alive:
            return JSONResponse({"status": "engine loop stopped"} | replicas, status_code=503)
        return JSONResponse({"status": "ok"} | replicas)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if model != model_name:
            return _error(protocol.BadRequest("model", f"model {model!r} is not served here; this server serves "
                                                       f"{model_name!r}", status=404))
        return JSONResponse(card)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> dict:
        return {"version": specdec.__version__}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's: the token ids a request with this prompt (or chat) runs, their count and the model's length."""
        try:
            prompt, field = protocol.parse_tokenize(_json(await _body(request, max_request_bytes)), model_name)
            # (as a request of one new token runs it: a prompt the model cannot hold is refused as a request is)
            ids = await asyncio.to_thread(_refused, executor.prepare, (prompt, SamplingParams(max_new_tokens=1)), field)
        except protocol.BadRequest as err:
            return _error(err)
        except _ClientGone:
            return Response(status_code=499)
        return JSONResponse({"count": len(ids), "max_model_len": executor.max_model_len, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """vLLM's: the text of token ids (special tokens kept)."""
        try:
            ids = protocol.parse_detokenize(_json(await _body(request, max_request_bytes)), model_name)
            text = await asyncio.to_thread(_refused, executor.detokenize, (ids,), "tokens")
        except protocol.BadRequest as err:
            return _error(err)
        except _ClientGone:
            return Response(status_code=499)
        return JSONResponse({"prompt": text})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _handle(request, chat=True)

    async def _handle(request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        try:
            body = _json(await _body(request, max_request_bytes))
            parsed = (protocol.parse_chat(body, model_name, default_chat_max_tokens) if chat
                      else protocol.parse_completion(body, model_name))
            # on a worker thread: the event loop and the engine loop go on meanwhile
            ids = await asyncio.to_thread(_prepare, executor, parsed)
        except protocol.BadRequest as err:
            return _error(err)
        except _ClientGone:  # gone before its body was read: nothing to answer, nothing to log
            return Response(status_code=499)
        # n samples of each prompt: n requests of it (the engine shares its KV), one choice each; every prompt's
        # requests are queued at once, so the engine batches them as it batches separate clients' requests
        n = parsed.params.n
        per_sample = [p for _, p in sample_requests("", parsed.params)]
        rids = [rid for prompt_ids in ids for rid in executor.enqueue_samples(prompt_ids, per_sample)]
        rid, samples = rids[0], [executor.astream(r) for r in rids]  # samples[i * n + j]: prompt i's sample j
        try:
            acks = await _until(request, asyncio.gather(*[s.__anext__() for s in samples]))  # admission or refusal
        except _ClientGone:
            await _close_all(samples)
            return Response(status_code=499)
        refused = next((k for k, a in enumerate(acks) if a.finish_reason == "error"), None)
        if refused is not None:
            await _close_all(samples)
            return _error(_refusal(acks[refused].error, parsed.prompt_fields[refused // n], parsed.max_tokens_field))
        timing = _Timing(metrics, arrival)
        if parsed.stream:
            echoes = await _echoes(executor, parsed, ids)
            return StreamingResponse(_events(rid, samples, n, chat, parsed.include_usage, timing,
                                             parsed.params.logprobs or 0, echoes),
                                     media_type="text/event-stream")
        try:
            finals = await _until(request, asyncio.gather(*[_final(s, timing, a) for s, a in zip(samples, acks)]))
        except _ClientGone:
            timing.abandoned()
            await _close_all(samples)
            return Response(status_code=499)
        outs = _per_prompt(rid, finals, n)
        timing.report(outs[0])
        failed = next((f for f in finals if f.finish_reason == "error"), None)
        if failed is not None:
            return _error(protocol.BadRequest(None, str(failed.error), 500))
        return JSONResponse(protocol.completion_body(rid, model_name, outs, chat, parsed.params.logprobs or 0,
                                                     await _echoes(executor, parsed, ids)))

    async def _events(rid: str, samples: list, n: int, chat: bool, include_usage: bool,
                      timing: _Timing, top: int, echoes: list[protocol.Echo] | None) -> AsyncIterator[str]:
        """The event stream of the samples' outputs (choice k: ``samples[k]``, prompt k // n's sample k % n), in
        the order they come, with their new tokens' log-probabilities when asked for (``top``: how many of the most
        probable) and, with ``echoes``, each choice's prompt first (in its first event, once its prompt's
        log-probabilities are known); the usage event and [DONE] once every sample has finished."""
        sent: dict[int, int] = {}  # choice -> characters of the tokens its events carried (its next text_offset)
        finals: dict[int, RequestOutput] = {}
        merged = _merged(samples)
        try:
            if chat:
                for k in range(len(samples)):
                    yield _sse(protocol.chunk_body(rid, model_name, None, None, chat, role=True, index=k))
            async for k, out in merged:
                timing.saw(out)
                if out.finish_reason == "error":
                    timing.report(out)
                    yield _sse(protocol.error_body(str(out.error), None, 500))
                    break
                if out.new_text or out.finished or out.new_logprobs:
                    text, lps, offset = out.new_text, out.new_logprobs, sent.get(k, 0)
                    if echoes is not None:
                        echo = echoes[k // n]
                        if k not in sent:  # the prompt first (its offsets from 0, then the output's)
                            text, lps = protocol.echoed(echo, out.prompt_logprobs, text, lps, top)
                            offset = len(echo.first_token) + sum(_chosen_chars(e) for e in
                                                                 (out.prompt_logprobs or [None])[1:])
                        elif echo.score_only:
                            text, lps = "", None if lps is None else []
                    sent[k] = offset + sum(_chosen_chars(e) for e in out.new_logprobs or ())
                    yield _sse(protocol.chunk_body(rid, model_name, text, out.finish_reason, chat, index=k,
                                                   logprobs=lps, top=top, offset=offset))
                if out.finished:
                    finals[k] = out
                if len(finals) == len(samples):
                    outs = _per_prompt(rid, [finals[k] for k in range(len(samples))], n)
                    timing.report(outs[0])
                    if include_usage:
                        yield _sse(protocol.usage_chunk(rid, model_name, outs, chat,
                                                        echoes is not None and echoes[0].score_only))
            yield "data: [DONE]\n\n"
        finally:  # also on disconnect: closing the stream cancels every unfinished request
            timing.abandoned()
            await merged.aclose()

    return app


def _prepare(executor: Executor | DataParallelExecutor, parsed: protocol.ParsedRequest) -> list[list[int]]:
    """Every prompt's token ids, checked as the engine checks a request; the first refusal is a BadRequest naming
    its prompt's field (``_refusal``)."""
    return [_refused(executor.prepare, (prompt, parsed.params), field, parsed.max_tokens_field)
            for prompt, field in zip(parsed.prompts, parsed.prompt_fields)]


def _refused(fn, args: tuple, field: str, max_tokens_field: str = "max_tokens"):
    """``fn(*args)`` (the executor's tokenising); what it raises becomes the BadRequest naming ``field``
    (``_refusal``)."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - a ValueError is the client's (400), anything else ours (500)
        raise _refusal(err, field, max_tokens_field) from None


def _per_prompt(rid: str, finals: list[RequestOutput], n: int) -> list[RequestOutput]:
    """The samples' final outputs (``finals[i * n + j]``: prompt i's sample j) as one output per prompt."""
    groups = [finals[i:i + n] for i in range(0, len(finals), n)]
    return [g[0] if n == 1 else RequestOutput.of_samples(rid, g) for g in groups]


class _Timing:
    """Arrival, first-token and end times of one HTTP request, reported once to the metrics."""

    def __init__(self, metrics: ServingMetrics, arrival: float) -> None:
        self.metrics, self.arrival, self.first, self.reported = metrics, arrival, None, False

    def saw(self, out: RequestOutput) -> None:
        if self.first is None and out.new_token_ids:
            self.first = time.perf_counter()

    def report(self, final: RequestOutput) -> None:
        self.reported = True
        self.metrics.observe_request(final.finish_reason, self.arrival, self.first, time.perf_counter(),
                                     len(final.token_ids))

    def abandoned(self) -> None:
        """The client went away before the final output: count the request as aborted."""
        if not self.reported:
            self.reported = True
            self.metrics.observe_request("abort", self.arrival, self.first, time.perf_counter(), 0)


async def _close_all(outputs: list) -> None:
    for out in outputs:
        await out.aclose()


async def _merged(samples: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(i, output) of every output of the samples' streams (``samples[i]``), as each arrives; closing it closes
    them all (which cancels the unfinished requests)."""
    arrived: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        async for out in samples[i]:
            await arrived.put((i, out))
        await arrived.put((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(samples))]
    try:
        running = len(samples)
        while running:
            i, out = await arrived.get()
            if out is None:
                running -= 1
            else:
                yield i, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close_all(samples)


async def _final(outputs: AsyncIterator[RequestOutput], timing: _Timing, first: RequestOutput) -> RequestOutput:
    """The final output of a request whose first output was ``first``."""
    timing.saw(first)
    if first.finished:
        return first
    async for out in outputs:
        timing.saw(out)
        if out.finished:
            return out
    raise RuntimeError("request stream ended without a final output")


async def _until(request: Request, awaitable):
    """Await ``awaitable`` unless the client disconnects first (then raise _ClientGone, once the awaitable is
    cancelled: the request's output stream is no longer running, so it can be closed)."""
    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled():  # retrieved, else asyncio logs "exception was never retrieved" for it
                task.exception()
            raise _ClientGone()


async def _body(request: Request, limit: int) -> bytes:
    """The request body; BadRequest (413) once it is longer than ``limit`` bytes, read no further; _ClientGone when
    the client disconnects before sending all of it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise _ClientGone() from None
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> protocol.BadRequest:
    return protocol.BadRequest(None, f"the request body has {size} bytes or more; this server reads at most "
                                     f"{limit} (--max-request-bytes)", status=413)


def _json(raw: bytes):
    """The parsed body; BadRequest for anything that is not JSON (bad syntax, bad UTF-8, nesting too deep)."""
    try:
        return json.loads(raw)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise protocol.BadRequest(None, f"the request body is not valid JSON ({err})") from None
    except RecursionError:
        raise protocol.BadRequest(None, "the request body is not valid JSON (nested too deeply)") from None


def _refusal(err: Exception | None, prompt_field: str, max_tokens_field: str) -> protocol.BadRequest:
    """The engine refused the prompt that errors name ``prompt_field`` ("prompt", "prompt[i]" or "messages"): a
    ValueError is the client's (400, naming the field it names: a FieldError's ``max_new_tokens`` is
    ``max_tokens_field``; none or "prompt", as a PromptError of the whole prompt, is ``prompt_field``), anything
    else ours (500)."""
    where = f"{prompt_field}: " if prompt_field.endswith("]") else ""  # which prompt of a batch
    if not isinstance(err, ValueError):
        return protocol.BadRequest(None, f"request failed: {where}{type(err).__name__}: {err}", 500)
    field = getattr(err, "field", None)
    field = max_tokens_field if field == "max_new_tokens" else prompt_field if field in (None, "prompt") else field
    return protocol.BadRequest(field, f"{field}: {err}" if field == prompt_field else f"{field}: {where}{err}")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error(err: protocol.BadRequest) -> Response:
    """``err`` as OpenAI's error body, in ASCII JSON: a lone surrogate it quotes from the request (which UTF-8 cannot
    encode) goes out as its \\u escape."""
    body = json.dumps(protocol.error_body(str(err), err.field, err.status))
    return Response(body, status_code=err.status, media_type="application/json")


class ServerThread:
    """Runs uvicorn for ``app`` in a background thread (tests, benchmarks); ``stop()`` shuts it down."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="specdec-uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.server.config.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)


def _chosen_chars(entry: dict) -> int:
    """The length of the text of a log-probabilities entry's own token (its first)."""
    return len(next(iter(entry.values())).decoded_token or "")


async def _echoes(executor, parsed: protocol.ParsedRequest, ids: list[list[int]]) -> list[protocol.Echo] | None:
    """Each completion prompt's ``Echo`` when the request asks for it: its text (as sent, or its ids' text) and its
    first token's text, decoded off the event loop."""
    if not parsed.echo:
        return None

    def one(prompt, prompt_ids: list[int]) -> protocol.Echo:
        text = prompt if isinstance(prompt, str) else executor.detokenize(prompt_ids)
        return protocol.Echo(text, executor.detokenize(prompt_ids[:1]), parsed.score_only)

    return await asyncio.to_thread(lambda: [one(p, i) for p, i in zip(parsed.prompts, ids)])
