"""Helpers of the serving tests and bench/serve_load.py: a byte-level tokenizer for the tiny models,
an in-process server, and a streaming client that reports what it saw."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
# a Mistral-style template: two user turns in a row raise (jinja2 TemplateError through raise_exception)
ALTERNATING_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
GOOD_CHAT = [{"role": "user", "content": "hello"}]
BAD_CHAT = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]  # refused by ALTERNATING_TEMPLATE


def byte_tokenizer():
    """A tokenizer whose 256 tokens are the 256 bytes (GPT-2 byte mapping, no merges), with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    order = _gpt2_byte_order()
    vocab = {order[b]: b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _gpt2_byte_order() -> list[str]:
    """The printable character GPT-2's byte-level scheme uses for each byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def with_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint folder ``src`` with the byte tokenizer saved into it."""
    if not (dst / "tokenizer.json").is_file():
        shutil.copytree(src, dst, dirs_exist_ok=True)
        byte_tokenizer().save_pretrained(str(dst))
    return dst


@dataclass
class StreamResult:
    """What one streaming client saw."""

    text: str = ""
    finish_reason: str | None = None
    status: int = 200
    ttft: float | None = None
    latency: float | None = None
    disconnected: bool = False
    error: str | None = None


def stream_completion(client, url: str, body: dict, disconnect_after: int | None = None) -> StreamResult:
    """POST a streaming /v1/completions with ``httpx.Client`` and collect the text; after
    ``disconnect_after`` content events, close the connection mid-stream."""
    import time

    res, t0, events = StreamResult(), time.perf_counter(), 0
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        res.status = r.status_code
        if r.status_code != 200:
            res.error = r.read().decode()
            return res
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                res.error = obj["error"]["message"]
                return res
            choice = obj["choices"][0]
            if choice["text"]:
                events += 1
                if res.ttft is None:
                    res.ttft = time.perf_counter() - t0
            res.text += choice["text"]
            res.finish_reason = choice["finish_reason"] or res.finish_reason
            if disconnect_after is not None and events >= disconnect_after:
                res.disconnected = True
                return res  # leaving the with-block closes the connection
    res.latency = time.perf_counter() - t0
    return res


@dataclass(frozen=True)
class LoadJob:
    """One client of a load test: its request body and, for a deliberate disconnect, after how many events."""

    body: dict
    disconnect_after: int | None = None


def mixed_jobs(n: int, seed: int = 0, disconnect_share: float = 0.1, long_tokens: int = 128) -> list[LoadJob]:
    """``n`` greedy streaming completions of mixed prompt and output lengths; a ``disconnect_share`` of
    them generate ``long_tokens`` tokens ignoring EOS and disconnect after 2 events."""
    import random

    rng = random.Random(seed)
    words = ["river", "stone", "light", "model", "token", "quiet", "seven", "orange", "cloud", "paper"]
    jobs = []
    for i in range(n):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        if rng.random() < disconnect_share:
            body = {"prompt": prompt, "max_tokens": long_tokens, "ignore_eos": True, "temperature": 0}
            jobs.append(LoadJob(body, disconnect_after=2))
        else:
            body = {"prompt": f"{i}: {prompt}", "max_tokens": rng.choice([4, 16, 32, 64]), "temperature": 0}
            jobs.append(LoadJob(body))
    return jobs


def run_alone(url: str, jobs: list[LoadJob]) -> dict[int, str]:
    """Greedy text of every job that does not disconnect, each request sent alone (one at a time)."""
    import httpx

    out = {}
    with httpx.Client(timeout=300) as http:
        for i, job in enumerate(jobs):
            if job.disconnect_after is None:
                r = http.post(f"{url}/v1/completions", json=job.body)
                r.raise_for_status()
                out[i] = r.json()["choices"][0]["text"]
    return out


def run_concurrently(url: str, jobs: list[LoadJob]) -> tuple[list[StreamResult], float]:
    """All jobs at once, one thread and one streaming connection each; (results, wall seconds)."""
    import threading
    import time

    import httpx

    results: list[StreamResult | None] = [None] * len(jobs)
    limits = httpx.Limits(max_connections=len(jobs) + 4, max_keepalive_connections=len(jobs) + 4)
    with httpx.Client(timeout=600, limits=limits) as http:
        def client(i: int) -> None:
            try:
                results[i] = stream_completion(http, url, jobs[i].body, jobs[i].disconnect_after)
            except Exception as err:  # noqa: BLE001 - reported as this client's error
                results[i] = StreamResult(status=0, error=f"{type(err).__name__}: {err}")

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results, time.perf_counter() - t0


def percentile(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p * (len(s) - 1)))]
