"""Helpers of the serving tests and bench/serve_load.py: a byte-level tokenizer for the tiny models,
an in-process server, and a streaming client that reports what it saw."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


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
