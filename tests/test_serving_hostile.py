"""Hostile HTTP input (issue 28): every bad request is a 4xx naming its field or cause, a huge body is refused
before it is read or tokenised and stalls no stream, and after the sweep the server is healthy, a greedy
request equals its solo run and the idle KV is back where it was."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest
from serving_helpers import BAD_CHAT, GOOD_CHAT

from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams
from specdec.serving.executor import Executor
from specdec.serving.server import DEFAULT_MAX_REQUEST_BYTES, ServerThread, build_app

pytestmark = pytest.mark.usefixtures("single_thread")
MODEL = "tiny"
PROMPT = "The quick brown fox"
PATHS = {"chat": "chat/completions", "completions": "completions"}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def server(strict_target):
    """(url, executor, error log records) of an n-gram server over the tiny target with a strict chat template."""
    executor = Executor(SpecEngine("ngram", strict_target, SpecConfig(tree="chain:3", num_blocks=128)))
    srv = ServerThread(build_app(executor, MODEL))  # (uvicorn's logging set-up drops earlier handlers)
    records = _Records()
    for name in ("uvicorn.error", "specdec"):
        logging.getLogger(name).addHandler(records)
    srv.start()
    yield srv.url, executor, records.records
    srv.stop()
    executor.shutdown()
    for name in ("uvicorn.error", "specdec"):
        logging.getLogger(name).removeHandler(records)


@pytest.fixture(scope="module")
def solo(strict_target):
    """Greedy text of PROMPT run alone in a plain engine (24 tokens)."""
    return SpecEngine(None, strict_target, SpecConfig(num_blocks=64)).generate(
        PROMPT, SamplingParams(max_new_tokens=24))[0].text


def _idle_kv(executor: Executor) -> int:
    deadline = time.monotonic() + 30
    while executor.run_on_loop(lambda e: e.scheduler.has_work):
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)
    return executor.run_on_loop(lambda e: e.allocator.num_blocks - e.allocator.num_free)


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": GOOD_CHAT, "max_tokens": 4, **fields}


# (path, raw body, status, the error's param, a phrase of its message): every case of issue 28 that is the client's
BAD = [
    ("chat", json.dumps(_chat(messages=BAD_CHAT)), 400, "messages", "roles must alternate"),
    ("completions", json.dumps(_completion(prompt="a\ud800b")), 400, "prompt", "lone surrogate"),
    ("chat", json.dumps(_chat(messages=[{"role": "user", "content": "\udc00"}])), 400, "messages", "lone surrogate"),
    ("completions", "[" * 100_000, 400, None, "nested too deeply"),
    ("completions", "{not json", 400, None, "not valid JSON"),
    ("completions", b'{"prompt": "\xff\xfe"}', 400, None, "not valid JSON"),
    ("completions", json.dumps(_completion(seed=2**64)), 400, "seed", "< 2**64"),
    # an integer past float64's range was a 500 (OverflowError checking that it is finite)
    ("completions", json.dumps(_completion(temperature=10**400)), 400, "temperature", "3.4e38"),
    ("completions", json.dumps(_completion(prompt=[5] * 510)), 400, "prompt", "510 tokens"),
    ("chat", json.dumps(_chat(max_completion_tokens=0)), 400, "max_completion_tokens", ">= 1"),
    ("chat", json.dumps(_chat(max_completion_tokens=-2, max_tokens=None)), 400, "max_completion_tokens", ">= 1"),
    ("chat", json.dumps(_chat(max_completion_tokens=3, max_tokens=5)), 400, "max_completion_tokens", "disagree"),
    ("chat", json.dumps(_chat(max_completion_tokens=10**6, max_tokens=None)), 400, "max_completion_tokens",
     "max length"),
    ("completions", json.dumps(_completion(user=5)), 400, "user", "string"),
    # a model that is no string was a 404 ("model ['tiny'] is not served here")
    ("completions", json.dumps(_completion(model=[MODEL])), 400, "model", "string"),
    ("chat", json.dumps(_chat(model={"id": MODEL})), 400, "model", "string"),
    # the error quoting a lone surrogate (not UTF-8) failed to render: a 500 and a traceback in the log
    ("completions", json.dumps(_completion(**{"\ud800": 1})), 400, "\ud800", "unknown field"),
    ("chat", json.dumps(_chat(user={"id": 1})), 400, "user", "string"),
    ("completions", "x" * (DEFAULT_MAX_REQUEST_BYTES + 1), 413, None, "--max-request-bytes"),
    # ran as [1]: one level of nesting is a batch of one prompt, two are no prompt at all
    ("completions", json.dumps(_completion(prompt=[[[5, 6]]])), 400, "prompt", "list of token ids"),
    ("completions", json.dumps(_completion(prompt=[True, 5])), 400, "prompt", "list of token ids"),
    # True == 1 in Python: a bool is no count of log-probabilities, and a count is no chat flag
    ("completions", json.dumps(_completion(logprobs=True)), 400, "logprobs", "integer"),
    ("completions", json.dumps(_completion(logprobs=21)), 400, "logprobs", "integer in [0, 20]"),
    ("completions", json.dumps(_completion(best_of=True)), 400, "best_of", "not supported"),
    ("chat", json.dumps(_chat(top_logprobs=False)), 400, "top_logprobs", "integer"),
    ("chat", json.dumps(_chat(logprobs=1)), 400, "logprobs", "boolean"),
    ("chat", json.dumps(_chat(top_logprobs=3)), 400, "top_logprobs", "'logprobs': true"),
    ("completions", json.dumps(_completion(echo=1)), 400, "echo", "boolean"),
    ("completions", json.dumps(_completion(echo=False, max_tokens=0)), 400, "max_tokens", "max_tokens"),
    ("chat", json.dumps(_chat(echo=True)), 400, "echo", "unknown field"),
    ("completions", json.dumps(_completion(prompt_logprobs=2)), 400, "prompt_logprobs", "unknown field"),
    ("completions", json.dumps(_completion(stream_options=[])), 400, "stream_options", "object"),  # was ignored
    ("chat", json.dumps(_chat(stream_options={"include_usage": True})), 400, "stream_options", "'stream': true"),
    # usage in every chunk (vLLM's) was dropped silently, and any value taken
    ("completions", json.dumps(_completion(stream=True, stream_options={"continuous_usage_stats": True})), 400,
     "stream_options", "continuous_usage_stats"),
    ("chat", json.dumps(_chat(stream=True, stream_options={"continuous_usage_stats": "x"})), 400, "stream_options",
     "continuous_usage_stats"),
    # checked at every step on the engine's thread: 0.35 s per token of every stream
    ("completions", json.dumps(_completion(stop=[f"#{i}" for i in range(150_000)])), 400, "stop", "at most 128"),
    # a message that is no {role, content} object was a plain-text 500 (KeyError/TypeError reading its role)
    ("chat", json.dumps(_chat(messages=[{"content": "hi"}])), 400, "messages[0]", "string 'role'"),
    ("chat", json.dumps(_chat(messages=["hi"])), 400, "messages[0]", "string 'role'"),
    ("chat", json.dumps(_chat(messages=[None])), 400, "messages[0]", "string 'role'"),
    ("chat", json.dumps(_chat(messages=[*GOOD_CHAT, 5])), 400, "messages[1]", "string 'role'"),
    ("chat", json.dumps(_chat(messages=[[1]])), 400, "messages[0]", "string 'role'"),
    ("chat", json.dumps(_chat(messages=[{"role": "wizard", "content": "hi"}])), 400, "messages[0].role",
     "['system', 'user', 'assistant']"),
]


def test_hostile_sweep_is_4xx_and_leaves_the_server_as_it_was(server, solo):
    url, executor, errors = server
    with httpx.Client(timeout=60) as http:
        first = http.post(f"{url}/v1/completions", json=_completion(prompt=PROMPT, max_tokens=24, temperature=0))
        kv_before = _idle_kv(executor)  # the prefix cache holds the prompt's blocks
        for path, body, status, param, phrase in BAD:
            r = http.post(f"{url}/v1/{PATHS[path]}", content=body, headers={"content-type": "application/json"})
            assert "error" in r.json(), (path, body[:80], r.text[:200])
            err = r.json()["error"]
            assert (r.status_code, err["param"]) == (status, param), (path, body[:60], err)
            assert phrase in err["message"], (phrase, err)
        chunked = http.post(f"{url}/v1/completions", content=iter([b"x" * 65536] * 40))  # no content-length
        assert chunked.status_code == 413 and "--max-request-bytes" in chunked.json()["error"]["message"]
        assert http.get(f"{url}/health").status_code == 200
        tiny = http.post(f"{url}/v1/completions", json=_completion(prompt=PROMPT, max_tokens=24, temperature=1e-40))
        greedy = http.post(f"{url}/v1/completions", json=_completion(prompt=PROMPT, max_tokens=24, temperature=0))
    assert first.json()["choices"][0]["text"] == solo
    assert greedy.status_code == 200 and greedy.json()["choices"][0]["text"] == solo
    assert tiny.json()["choices"][0]["text"] == solo  # below the floor: greedy, not garbage
    assert _idle_kv(executor) == kv_before
    chat = httpx.post(f"{url}/v1/chat/completions", json=_chat(max_tokens=None, max_completion_tokens=5,
                                                               ignore_eos=True), timeout=60)
    assert chat.json()["usage"]["completion_tokens"] == 5  # max_completion_tokens alone sets the length
    assert executor.alive and not [r for r in errors if r.levelno >= logging.ERROR]


def test_a_client_leaving_a_non_streaming_request_logs_no_traceback(server):
    """Closing the output stream while its reader task still ran logged 'Exception in ASGI application ...
    aclose(): asynchronous generator is already running' for every such disconnect."""
    url, executor, errors = server
    before = len(errors)
    for _ in range(2):
        with httpx.Client(timeout=httpx.Timeout(30, read=0.3)) as http, pytest.raises(httpx.ReadTimeout):
            http.post(f"{url}/v1/completions", json=_completion(prompt=PROMPT, max_tokens=400, ignore_eos=True))
    _idle_kv(executor)
    time.sleep(0.5)  # the server notices the disconnect within its poll interval
    assert [r.getMessage() for r in errors[before:]] == []


def _stream_gaps(url: str, until: threading.Event, started: threading.Event | None = None) -> list[float]:
    """Stream completions back to back until ``until`` is set (the one under way when it is set runs to its end);
    every wait for an event (the first one too). ``started`` is set at the first event."""
    gaps = []
    with httpx.Client(timeout=60) as http:
        while not until.is_set():
            body = _completion(prompt=PROMPT, max_tokens=64, ignore_eos=True, stream=True)
            last = time.perf_counter()
            with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        now = time.perf_counter()
                        gaps.append(now - last)
                        last = now
                        if started is not None:
                            started.set()
    return gaps


@pytest.mark.parametrize("size, status", [(10 << 20, 413), (600_000, 400)])
def test_a_huge_body_stalls_no_stream(server, size, status):
    """A 10 MB body is refused (413) unread; a 600 kB one is tokenised on a worker thread (about 2 s with the byte
    tokenizer) and refused for its length. Meanwhile streams see no gap over 0.5 s between events: the prompt was
    tokenised on the engine loop and every stream froze for as long."""
    url = server[0]
    done, streaming, answer = threading.Event(), threading.Event(), {}
    body = json.dumps(_completion(prompt="y" * size)).encode()  # (encoded here: the server shares this process's GIL)

    def send_big() -> None:
        try:
            streaming.wait(30)  # (sent while a stream runs, which then goes on to its 64 events)
            with httpx.Client(timeout=120) as http:
                r = http.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"})
                answer["status"], answer["error"] = r.status_code, r.json()["error"]
        except httpx.TransportError as err:  # the server answered 413 and closed before the body was sent
            answer["status"], answer["error"] = 413, repr(err)
        finally:
            done.set()

    big = threading.Thread(target=send_big)
    big.start()
    gaps = _stream_gaps(url, done, streaming)
    big.join()
    assert answer["status"] == status, answer
    if status == 400:
        assert answer["error"]["param"] == "prompt" and "tokens" in answer["error"]["message"]
    assert len(gaps) > 20 and max(gaps) < 0.5, max(gaps)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_clients_leaving_mid_body_or_mid_request_log_nothing(server):
    """A client that disconnected before sending its whole body logged 'Exception in ASGI application' with a
    ClientDisconnect traceback, and one that left a non-streaming request logged asyncio's '_GatheringFuture
    exception was never retrieved' (once the future was collected): two error logs per disconnect."""
    import gc
    import socket

    url, executor, errors = server
    before, seen = len(errors), _Capture()
    logging.getLogger("asyncio").addHandler(seen)
    try:
        host, port = url.removeprefix("http://").split(":")
        for _ in range(2):
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"content-length: 1000\r\n\r\n{\"prompt\": \"hi")
                time.sleep(0.2)
        for _ in range(2):
            with httpx.Client(timeout=httpx.Timeout(30, read=0.3)) as http, pytest.raises(httpx.ReadTimeout):
                http.post(f"{url}/v1/completions", json=_completion(prompt=PROMPT, max_tokens=400, ignore_eos=True))
        _idle_kv(executor)
        time.sleep(0.5)  # the server notices a disconnect within its poll interval
        gc.collect()  # (a future's unretrieved exception is logged when it is collected)
    finally:
        logging.getLogger("asyncio").removeHandler(seen)
    assert [r.getMessage() for r in errors[before:]] == [] and seen.messages == []
    assert httpx.get(f"{url}/health").status_code == 200


def test_routing_errors_are_openai_errors(server):
    """Starlette's 404 and 405 came back as {"detail": ...}, which OpenAI clients do not read; HEAD /health was a
    405 and GET /v1/models/{model} (``client.models.retrieve``) a 404."""
    url = server[0]
    with httpx.Client(timeout=30) as http:
        for method, path, status in [("GET", "/v1/completions", 405), ("GET", "/v1/nothing", 404),
                                     ("DELETE", "/v1/models", 405)]:
            r = http.request(method, f"{url}{path}")
            assert r.status_code == status and r.json()["error"]["code"] == status, (method, path, r.text)
            assert path in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"
        assert "POST" in http.get(f"{url}/v1/completions").headers["allow"]
        assert http.head(f"{url}/health").status_code == 200
        assert http.get(f"{url}/v1/models/{MODEL}").json()["id"] == MODEL
        other = http.get(f"{url}/v1/models/gpt-4")
        assert other.status_code == 404 and other.json()["error"]["param"] == "model"


@pytest.fixture(scope="module")
def small_pool(strict_target):
    """(url, longest prompt the pool holds) of a server whose 8-block KV pool is smaller than the model's 512
    positions."""
    engine = SpecEngine("ngram", strict_target, SpecConfig(tree="chain:3", num_blocks=8, block_size=16))
    executor = Executor(engine)
    srv = ServerThread(build_app(executor, MODEL)).start()
    # a request of p prompt tokens and m new ones holds p + m + lookahead (3) + 1 positions in 8 * 16
    yield srv.url, 8 * 16 - 1 - 3 - 1
    srv.stop()
    executor.shutdown()


def test_a_prompt_the_pool_cannot_hold_is_refused_for_its_length(small_pool):
    """A prompt over the KV pool was refused naming max_tokens ("lower max_new_tokens") even at max_tokens 4:
    now the prompt (or the messages), with the longest prompt the pool holds, which is served."""
    url, longest = small_pool
    with httpx.Client(timeout=60) as http:
        def post(path: str, body: dict) -> httpx.Response:
            return http.post(f"{url}/v1/{PATHS[path]}", json=body)

        r = post("completions", _completion(prompt=[5] * (longest + 1), max_tokens=4))
        assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt"), r.text
        assert f"at most {longest} tokens" in r.json()["error"]["message"]
        chat = post("chat", _chat(messages=[{"role": "user", "content": "a" * 300}]))
        assert (chat.status_code, chat.json()["error"]["param"]) == (400, "messages"), chat.text
        fits = post("completions", _completion(prompt=[5] * longest, max_tokens=1, ignore_eos=True))
        assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 1, fits.text
        # the prompt fits, the output does not: max_tokens (or the chat field that set it) is at fault
        r = post("completions", _completion(prompt=[5] * 20, max_tokens=200))
        assert (r.status_code, r.json()["error"]["param"]) == (400, "max_tokens"), r.text
        assert f"at most {longest - 20 + 1} new tokens" in r.json()["error"]["message"]
        chat = post("chat", _chat(max_tokens=None, max_completion_tokens=200))
        assert (chat.status_code, chat.json()["error"]["param"]) == (400, "max_completion_tokens"), chat.text


def test_an_unset_max_tokens_is_the_default_or_the_room_the_prompt_leaves(server, small_pool):
    """A request that set no max_tokens, with a prompt leaving less room than the endpoint's default (chat 256,
    completions 16), was a 400 blaming a max_tokens "got 256" it never sent; as in vLLM it now gets the room left
    (the 512-position context less the 3-token lookahead, or what the KV pool holds). A max_tokens it sent that does
    not fit is still a 400 naming max_tokens; a prompt leaving no room, one naming the prompt."""
    (url, _, _), (pool_url, longest) = server, small_pool
    with httpx.Client(timeout=60) as http:
        def post(base: str, path: str, body: dict) -> httpx.Response:
            return http.post(f"{base}/v1/{PATHS[path]}", json={"model": MODEL, "ignore_eos": True, **body})

        def generated(r: httpx.Response) -> tuple[int, int, str]:
            assert r.status_code == 200, r.text
            usage, choice = r.json()["usage"], r.json()["choices"][0]
            return usage["prompt_tokens"], usage["completion_tokens"], choice["finish_reason"]

        assert generated(post(url, "completions", {"prompt": [5] * 500})) == (500, 512 - 3 - 500, "length")
        assert generated(post(url, "completions", {"prompt": [5] * 20})) == (20, 16, "length")
        prompt, out, reason = generated(post(url, "chat", {"messages": [{"role": "user", "content": "a" * 400}]}))
        assert prompt > 400 and (out, reason) == (512 - 3 - prompt, "length")
        prompt, out, _ = generated(post(pool_url, "chat", {"messages": GOOD_CHAT}))
        assert out == longest + 1 - prompt < 256
        sent = post(url, "completions", {"prompt": [5] * 500, "max_tokens": 16})
        assert (sent.status_code, sent.json()["error"]["param"]) == (400, "max_tokens"), sent.text
        full = post(url, "completions", {"prompt": [5] * 509})
        assert (full.status_code, full.json()["error"]["param"]) == (400, "prompt"), full.text
        assert "prompt has 509 tokens" in full.json()["error"]["message"]
