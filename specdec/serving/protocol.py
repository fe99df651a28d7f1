"""OpenAI request bodies -> (prompts, SamplingParams), and engine outputs -> OpenAI response bodies.

Validation is strict: a field of the wrong type or out of range, an unknown field, or a feature this
engine does not have (tools, best_of) is a ``BadRequest`` naming the field. The sampling fields (n, min_p, the
repetition, presence and frequency penalties, logit_bias, vLLM's min_tokens, allowed_token_ids and bad_words
included) are checked by ``SamplingParams`` itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from specdec.errors import FieldError
from specdec.outputs import AcceptanceStats, Logprob, RequestOutput
from specdec.sampling_params import MAX_LOGPROBS, SamplingParams


class BadRequest(ValueError):
    """A request body the server refuses (HTTP 400); ``field`` names the offending field."""

    def __init__(self, field: str | None, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status = status


_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "ignore_eos", "n", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "min_p", "min_tokens", "allowed_token_ids",
                    "logit_bias", "bad_words", "include_stop_str_in_output", "truncate_prompt_tokens",
                    "skip_special_tokens")  # -> SamplingParams
_COMMON = {"model", "stop", "stream", "stream_options", "user", *_SAMPLING_FIELDS}
# accepted only at the value that means "off": these features do not exist here
_OFF_VALUES = {"best_of": (None, 1), "suffix": (None,), "tools": (None,), "tool_choice": (None, "none"),
               "response_format": (None,), "parallel_tool_calls": (None,)}
MAX_USER_CHARS = 256  # the end-user id a client may send (kept for logs, never interpreted)
# prompts of one /v1/completions body: each runs as n requests of its own, so a cap keeps one body from queueing an
# unbounded number of requests (lm-eval batches a few dozen; a client with more sends several requests)
MAX_PROMPTS = 256
# choices of one body (prompts x n): the requests it queues at most, whatever the mix of the two
MAX_CHOICES = 1024
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo"}  # logprobs: how many top tokens' (an int: OpenAI's
# legacy form); echo: the prompt before each choice's text (and its tokens before the output's in logprobs)
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}  # logprobs: a bool
# /tokenize and /detokenize (vLLM's, outside /v1); the flags only at what a request runs with (True)
TOKENIZE_FLAGS = ("add_special_tokens", "add_generation_prompt")
TOKENIZE_FIELDS = {"model", "prompt", "messages", *TOKENIZE_FLAGS}
DETOKENIZE_FIELDS = {"model", "tokens"}
# the roles of a chat message: a "tool" message answers a tool call, and tools are refused (_OFF_VALUES); OpenAI's
# "developer" is a role the served models' chat templates do not know
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ParsedRequest:
    """What the engine needs from one OpenAI request: one prompt, or several of a completions batch, each run with
    ``params`` (its n samples); ``prompt_fields[i]`` is the field that errors of ``prompts[i]`` name."""

    prompts: tuple[Any, ...]  # text, token ids, or chat messages
    prompt_fields: tuple[str, ...]  # "prompt" (one prompt), "prompt[i]" (a batch) or "messages"
    params: SamplingParams
    stream: bool
    include_usage: bool
    max_tokens_field: str = "max_tokens"  # the field that set params.max_new_tokens (named in its errors)
    echo: bool = False  # completions: the prompt comes before each choice's text (and in its logprobs)
    score_only: bool = False  # echo with max_tokens 0: the prompt scored, no output (one token is run, not sent)


def parse_completion(body: Any, model: str, default_max_tokens: int = 16) -> ParsedRequest:
    """A /v1/completions body; ``prompt`` is one prompt (a string or a list of token ids, alone or in a list of
    one) or, as in OpenAI's API and vLLM, a list of up to ``MAX_PROMPTS`` of them (errors name ``prompt[i]``)."""
    _check_fields(body, COMPLETION_FIELDS, model)
    if "prompt" not in body:
        raise BadRequest("prompt", "field 'prompt' is required")
    prompts, fields = _completion_prompts(body["prompt"])
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise BadRequest("echo", f"field 'echo' must be a boolean, got {_short(echo)}")
    score_only = echo and _is_int(body.get("max_tokens")) and body["max_tokens"] == 0
    if score_only:  # (OpenAI's way to score a prompt: its log-probabilities, no output)
        body = {**body, "max_tokens": 1}
    logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    params = _params(body, default_max_tokens, logprobs=logprobs)
    if echo and logprobs is not None:
        params = replace(params, prompt_logprobs=logprobs)
    if len(prompts) * params.n > MAX_CHOICES:
        raise BadRequest("n", f"{len(prompts)} prompts x n={params.n} are {len(prompts) * params.n} choices; a "
                              f"request holds at most {MAX_CHOICES} (send fewer prompts or samples a request)")
    return ParsedRequest(prompts, fields, params, *_stream_flags(body), echo=echo, score_only=score_only)


def parse_chat(body: Any, model: str, default_max_tokens: int = 256) -> ParsedRequest:
    """A /v1/chat/completions body; ``messages`` is a list of {role, content}, content a string or a list of text
    parts (``prompts.chat_message_text``, whose PromptError is a 400 naming the message or part at fault)."""
    from specdec.prompts import PromptError

    _check_fields(body, CHAT_FIELDS, model)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages", "field 'messages' must be a non-empty list of {role, content} objects")
    try:
        messages = [_message(m, i) for i, m in enumerate(msgs)]
    except PromptError as err:
        raise BadRequest(err.field, str(err)) from None
    field = _max_tokens_field(body)
    return ParsedRequest((messages,), ("messages",), _params(body, default_max_tokens, field, _chat_logprobs(body)),
                         *_stream_flags(body), field)


def parse_tokenize(body: Any, model: str) -> tuple[Any, str]:
    """A /tokenize body (vLLM's): ``prompt`` (a string) or ``messages`` (a chat, rendered as /v1/chat/completions
    renders it), with an optional ``model`` (and ``add_special_tokens``, ``add_generation_prompt``, only true):
    (the prompt, the field its errors name)."""
    _check_fields(body, TOKENIZE_FIELDS, model)
    for flag in TOKENIZE_FLAGS:
        if body.get(flag, True) is not True:
            raise BadRequest(flag, f"field '{flag}' may only be true (the ids a request runs), got "
                                   f"{_short(body[flag])}")
    if ("prompt" in body) == ("messages" in body):
        raise BadRequest(None, "give one of 'prompt' (a string) and 'messages' (a chat)")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise BadRequest("prompt", f"field 'prompt' must be a string, got {_short(body['prompt'])}")
        return body["prompt"], "prompt"
    msgs = body["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages", "field 'messages' must be a non-empty list of {role, content} objects")
    from specdec.prompts import PromptError

    try:
        return [_message(m, i) for i, m in enumerate(msgs)], "messages"
    except PromptError as err:
        raise BadRequest(err.field, str(err)) from None


def parse_detokenize(body: Any, model: str) -> list[int]:
    """A /detokenize body (vLLM's): ``tokens``, a list of token ids, with an optional ``model``. Whether each id is
    in the vocabulary is the engine's check (``SpecEngine.detokenize``)."""
    _check_fields(body, DETOKENIZE_FIELDS, model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadRequest("tokens", f"field 'tokens' must be a list of token ids (integers), got {_short(tokens)}")
    return tokens


def _message(m: Any, i: int) -> dict:
    """``messages[i]`` as {role, content}: its shape is checked first (``chat_message_text``: a PromptError naming
    ``messages[i]``), then its role must be one of ``CHAT_ROLES``."""
    from specdec.prompts import chat_message_text

    text = chat_message_text(m, i)
    if m["role"] not in CHAT_ROLES:
        raise BadRequest(f"messages[{i}].role", f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got "
                                                f"{_short(m['role'])}")
    return {"role": m["role"], "content": text}


def _chat_logprobs(body: dict) -> int | None:
    """``SamplingParams.logprobs`` of a chat body: None unless ``logprobs`` is true, then ``top_logprobs`` (0 when
    not given), which asks for ``logprobs`` true (OpenAI's rule)."""
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise BadRequest("logprobs", f"field 'logprobs' must be a boolean, got {_short(want)}")
    top = _integer(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
    if top and not want:
        raise BadRequest("top_logprobs", "field 'top_logprobs' needs 'logprobs': true")
    return top if want else None


def _max_tokens_field(body: dict) -> str:
    """The field of a chat body that sets the output length: ``max_completion_tokens`` (OpenAI's current name)
    or ``max_tokens``; both only when they agree."""
    if body.get("max_completion_tokens") is None:
        return "max_tokens"
    new = _integer(body, "max_completion_tokens", None, lo=1)
    if body.get("max_tokens") is not None and _integer(body, "max_tokens", None, lo=1) != new:
        raise BadRequest("max_completion_tokens", f"fields 'max_completion_tokens' ({new}) and 'max_tokens' "
                                                  f"({body['max_tokens']}) disagree; set only one")
    return "max_completion_tokens"


def _check_fields(body: Any, allowed: set[str], model: str) -> None:
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    for key, value in body.items():
        if key in _OFF_VALUES:
            if not _is_off(value, _OFF_VALUES[key]):
                raise BadRequest(key, f"field '{key}' is not supported by this server (allowed: "
                                      f"{[v for v in _OFF_VALUES[key] if v is not None] or 'null'})")
        elif key not in allowed:
            raise BadRequest(key, f"unknown field '{key}'; allowed fields: {sorted(allowed)}")
    if not isinstance(body.get("model"), (str, type(None))):
        raise BadRequest("model", f"field 'model' must be a string, got {_short(body['model'])}")
    if body.get("model") not in (None, model):
        raise BadRequest("model", f"model {body.get('model')!r} is not served here; this server serves {model!r}",
                         status=404)
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise BadRequest("user", f"field 'user' must be a string of at most {MAX_USER_CHARS} characters, got "
                                 f"{_short(user)}")


def _is_off(value: Any, off_values: tuple) -> bool:
    """``value`` is one of ``off_values`` and of its type: 0 is not False (``logprobs`` 0 of a completion asks
    for the sampled token's logprob) and True is not 1."""
    return any(value is None if off is None else type(value) is type(off) and value == off for off in off_values)


def _completion_prompts(prompt: Any) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    """(prompts, the field each one's errors name). A list holding a string or a list is a batch of prompts (one
    prompt when it holds one: named ``prompt``, as before batches); anything else is one prompt."""
    if not isinstance(prompt, list) or not any(isinstance(p, (str, list)) for p in prompt):
        return (_one_prompt(prompt, "prompt"),), ("prompt",)
    if len(prompt) > MAX_PROMPTS:
        raise BadRequest("prompt", f"field 'prompt' holds {len(prompt)} prompts; a request holds at most "
                                   f"{MAX_PROMPTS} (send the rest in other requests)")
    if len(prompt) == 1:
        return (_one_prompt(prompt[0], "prompt"),), ("prompt",)
    bare = next((i for i, p in enumerate(prompt) if not isinstance(p, (str, list))), None)
    if bare is not None:  # e.g. ["A", 5]: neither a list of prompts nor one list of token ids
        raise BadRequest(f"prompt[{bare}]", f"field 'prompt' mixes prompts and other values: prompt[{bare}] is "
                                            f"{_short(prompt[bare])}; send a list of token ids, or a list of prompts "
                                            "(strings or lists of token ids)")
    fields = tuple(f"prompt[{i}]" for i in range(len(prompt)))
    return tuple(_one_prompt(p, field) for p, field in zip(prompt, fields)), fields


def _one_prompt(prompt: Any, field: str) -> str | list[int]:
    """``prompt`` (the body's ``field``) when it is a non-empty string or a non-empty list of token ids."""
    if isinstance(prompt, (str, list)) and not prompt:
        raise BadRequest(field, f"field '{field}' must not be empty")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return list(prompt)
    raise BadRequest(field, f"field '{field}' must be a string or a list of token ids, got {_short(prompt)}")


def _params(body: dict, default_max_tokens: int, max_tokens_field: str = "max_tokens",
            logprobs: int | None = None) -> SamplingParams:
    """The body's sampling fields checked by ``SamplingParams`` itself, so the server accepts exactly what the
    Python API does (top_k -1 = off, as in vLLM); the output length comes from ``max_tokens_field``; ``logprobs``:
    the top tokens' log-probabilities asked for (the endpoints spell it differently). A FieldError becomes a
    BadRequest naming the body's field."""
    given = {name: body[name] for name in _SAMPLING_FIELDS if name != "max_tokens" and body.get(name) is not None}
    if logprobs is not None:
        given["logprobs"] = logprobs
    if "logit_bias" in given:
        given["logit_bias"] = _logit_bias(given["logit_bias"])
    if body.get(max_tokens_field) is not None:
        given["max_tokens"] = body[max_tokens_field]
    else:  # the default, as vLLM's: the engine lowers it to the room the prompt leaves
        given.update(max_tokens=default_max_tokens, fit_max_new_tokens=True)
    try:
        return SamplingParams(**{"temperature": 1.0, **given}, stop=_stop(body.get("stop")))
    except FieldError as err:
        name = max_tokens_field if err.field in ("max_new_tokens", "max_tokens") else err.field
        raise BadRequest(name, f"field '{name}': {err}") from None


def _logit_bias(bias: Any) -> Any:
    """OpenAI's ``logit_bias``, an object whose keys are token ids as strings (JSON's keys are), with int keys;
    its values (and a value that is no object) are left for ``SamplingParams`` to check."""
    if not isinstance(bias, dict):
        return bias
    bad = next((k for k in bias if not (isinstance(k, str) and k.isascii() and k.isdigit())), None)
    if bad is not None:
        raise BadRequest("logit_bias", f"field 'logit_bias' must map token ids (strings of digits, as \"50256\") "
                                       f"to biases, got the key {_short(bad)}")
    return {int(k): v for k, v in bias.items()}


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop", f"field 'stop' must be a non-empty string or a list of them, got {_short(stop)}")
    return tuple(stop)


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise BadRequest("stream", f"field 'stream' must be a boolean, got {stream!r}")
    opts = body.get("stream_options")
    opts = {} if opts is None else opts
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequest("stream_options", f"field 'stream_options' must be an object that may only hold "
                                           f"'include_usage', got {_short(opts)}")
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise BadRequest("stream_options", "stream_options.include_usage must be a boolean")
    if not _is_off(opts.get("continuous_usage_stats"), (None, False)):  # vLLM's usage in every chunk
        raise BadRequest("stream_options", "stream_options.continuous_usage_stats is not supported by this server "
                                           "(allowed: false); the usage comes in one chunk at the end")
    if opts and not stream:  # (OpenAI and vLLM refuse it too: a non-streamed reply has no chunks to add usage to)
        raise BadRequest("stream_options", "field 'stream_options' is only allowed with 'stream': true")
    return bool(stream), include


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _integer(body: dict, name: str, default, lo: int, hi: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(name, f"field '{name}' must be an integer {bound}, got {_short(value)}")
    return value


def _short(value: Any) -> str:
    """``repr(value)``, cut to a readable length (a client may send megabytes)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


# ---------------------------------------------------------------------- responses


def error_body(message: str, field: str | None, status: int) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": field, "code": status}}


def usage(outs: list[RequestOutput], scored_only: bool = False) -> dict:
    """OpenAI usage plus ``mean_accepted_length`` (tokens committed per target forward) and ``acceptance_rate``,
    over every prompt's output (``outs[i]``: prompt i's, its samples in ``outputs``): each prompt's tokens counted
    once, the completion tokens of every choice (none when the prompts were only scored: the token run is not
    sent)."""
    stats = AcceptanceStats()
    for out in outs:
        stats.merge(out.stats)
    n_prompt = sum(len(out.prompt_token_ids) for out in outs)
    n_out = 0 if scored_only else sum(len(c.token_ids) for out in outs for c in out.outputs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "mean_accepted_length": stats.mean_accepted_length, "acceptance_rate": stats.acceptance_rate}


@dataclass(frozen=True)
class Echo:
    """A completion prompt echoed before its choices (``echo``): its text, its first token's text (the first token
    has no log-probability), and whether the output is left out (``score_only``)."""

    text: str
    first_token: str
    score_only: bool = False


def completion_body(rid: str, model: str, outs: list[RequestOutput], chat: bool, top: int = 0,
                    echoes: list[Echo] | None = None) -> dict:
    """The non-streaming response for finished requests: one choice per sample of each prompt (``outs[i]``: prompt
    i's output, its samples in ``outputs``), in that order; choice ``index`` is i * n + sample (vLLM's). ``top``:
    the most probable tokens each token's log-probabilities list (when the request asked for them); ``echoes[i]``:
    prompt i echoed before its choices' text and log-probabilities."""
    choices = []
    for i, out in enumerate(outs):
        for c in out.outputs:
            index = i * len(out.outputs) + c.index
            if chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": logprobs_body(c.logprobs, top, chat), "finish_reason": c.finish_reason})
                continue
            text, lps = c.text, logprobs_body(c.logprobs, top, chat)
            if echoes is not None:
                text, lps = echoed(echoes[i], out.prompt_logprobs, c.text, c.logprobs, top)
            choices.append({"index": index, "text": text, "logprobs": lps, "finish_reason": c.finish_reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": usage(outs, echoes is not None and all(e.score_only for e in echoes))}


def chunk_body(rid: str, model: str, text: str | None, finish_reason: str | None, chat: bool,
               role: bool = False, index: int = 0, logprobs: list[dict[int, Logprob]] | None = None, top: int = 0,
               offset: int = 0) -> dict:
    """One server-sent event of a streaming response, for choice ``index``; ``logprobs``: its new tokens' (their
    text starting ``offset`` characters into the choice's, for a completion's ``text_offset``), or a completion's
    log-probabilities already in their shape (``echoed``)."""
    lps = logprobs if isinstance(logprobs, dict) else logprobs_body(logprobs, top, chat, offset)
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": lps, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, outs: list[RequestOutput], chat: bool, scored_only: bool = False) -> dict:
    """The last event of a stream with ``stream_options.include_usage``: ``usage(outs)`` and no choice."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [], "usage": usage(outs, scored_only)}


def logprobs_body(entries: list[dict[int, Logprob]] | None, top: int, chat: bool, offset: int = 0) -> dict | None:
    """Output tokens' log-probabilities (``RequestOutput.logprobs``: per token the chosen one first) in OpenAI's
    shape: a chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}`` with the ``top`` most probable, or a
    completion's ``{tokens, token_logprobs, top_logprobs, text_offset}`` (each top dict holds the chosen token too,
    as vLLM's). None when not asked for."""
    if entries is None:
        return None
    tokens = [next(iter(e.items())) for e in entries]  # the chosen (id, Logprob) of each token
    ranked = [sorted(e.values(), key=lambda v: -v.logprob)[:top] for e in entries]
    if chat:
        return {"content": [{**_token_logprob(lp), "top_logprobs": [_token_logprob(v) for v in best]}
                            for (_, lp), best in zip(tokens, ranked)]}
    offsets, at = [], offset
    for _, lp in tokens:
        offsets.append(at)
        at += len(lp.decoded_token or "")
    return {"tokens": [lp.decoded_token for _, lp in tokens], "token_logprobs": [_finite(lp) for _, lp in tokens],
            "top_logprobs": [{v.decoded_token: _finite(v) for v in [lp, *best]}
                             for (_, lp), best in zip(tokens, ranked)],
            "text_offset": offsets}


def _token_logprob(lp: Logprob) -> dict:
    text = lp.decoded_token or ""
    raw = lp.token_bytes if lp.token_bytes is not None else text.encode("utf-8", "replace")
    return {"token": text, "logprob": _finite(lp), "bytes": list(raw)}


def _finite(lp: Logprob) -> float:
    """A log-probability JSON can carry: OpenAI's -9999.0 for an impossible token (-inf)."""
    return max(lp.logprob, -9999.0)


def echoed(echo: Echo, prompt_entries, text: str, entries, top: int) -> tuple[str, dict | None]:
    """A completion choice's text and legacy log-probabilities with its prompt first (``echo``): the prompt's
    tokens (the first with no log-probability, as OpenAI's), then the output's, unless ``echo.score_only``."""
    if echo.score_only:
        text, entries = "", None if entries is None else []
    if entries is None:
        return echo.text + text, None
    body = logprobs_body([*(prompt_entries or [None])[1:], *entries], top, False, len(echo.first_token))
    return echo.text + text, {"tokens": [echo.first_token, *body["tokens"]],
                              "token_logprobs": [None, *body["token_logprobs"]],
                              "top_logprobs": [None, *body["top_logprobs"]], "text_offset": [0, *body["text_offset"]]}
