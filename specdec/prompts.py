"""Turning a user's prompt (text, token ids or chat messages) into token ids."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping

PROMPT_FORMS = ("a str, a list/tuple of int token ids, a 1-D integer tensor or array, a list of chat "
                "messages ({role, content} dicts), or vLLM's {'prompt': text} / {'prompt_token_ids': ids}")


class PromptError(ValueError):
    """A prompt that cannot be run; the message names the problem and the allowed range (``field``: the part of the
    prompt at fault, such as ``messages[0].content[1]``, where one is named)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def is_token_ids(prompt) -> bool:
    """True for one prompt given as token ids: a list/tuple of integers (any integral type, not bool)
    or a 1-D integer torch tensor / numpy array."""
    if _is_array(prompt):
        return prompt.ndim == 1 and _integer_dtype(prompt)
    return isinstance(prompt, (list, tuple)) and all(_is_int(t) for t in prompt)


def is_chat(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def is_vllm_prompt(prompt) -> bool:
    """vLLM's prompt dicts: ``{"prompt": text}`` (TextPrompt) or ``{"prompt_token_ids": ids}`` (TokensPrompt), told
    from a chat message by having one of those keys and no role."""
    return isinstance(prompt, Mapping) and "role" not in prompt and ("prompt" in prompt or "prompt_token_ids" in prompt)


def unwrap_vllm_prompt(prompt):
    """The text or the token ids of a vLLM prompt dict (its token ids when it has both); PromptError for a key this
    engine does not read (multi-modal data, a cache salt, ...), named."""
    extra = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if extra:
        raise PromptError(f"a vLLM prompt dict's {extra} {'is' if len(extra) == 1 else 'are'} not supported: give "
                          "'prompt' (text) or 'prompt_token_ids'", "prompt")
    return prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]


def as_prompt_list(prompts) -> list:
    """One prompt (text, token ids, chat messages, a vLLM prompt dict) or a batch of them (a list, a 2-D tensor) ->
    a list (vLLM's prompt dicts as their text or ids)."""
    if is_vllm_prompt(prompts):
        return [unwrap_vllm_prompt(prompts)]
    if isinstance(prompts, (list, tuple)) and prompts and all(is_vllm_prompt(p) for p in prompts):
        return [unwrap_vllm_prompt(p) for p in prompts]
    if isinstance(prompts, str) or is_chat(prompts) or (is_token_ids(prompts) and len(prompts) > 0):
        return [prompts]
    _check_batch(prompts)
    return list(prompts)


def _check_batch(prompts) -> None:
    """PromptError for a value that iterates but is no batch of prompts: a single chat message, bytes, or an
    array that is neither one prompt (1-D) nor a batch (2-D) of integer token ids."""
    if isinstance(prompts, (bytes, bytearray, memoryview)):
        raise PromptError(f"prompts must be one prompt or a list of prompts, got {type(prompts).__name__}: "
                          "decode it to a str")
    if isinstance(prompts, Mapping):
        raise PromptError("prompts is one chat message (a dict); a chat prompt is a list of messages: "
                          "[{'role': ..., 'content': ...}]")
    if _is_array(prompts) and (prompts.ndim not in (1, 2) or not _integer_dtype(prompts)):
        raise PromptError(f"a tensor or array of prompts must hold integer token ids, 1-D (one prompt) or 2-D "
                          f"(a batch), got {_describe(prompts)}{' (0-d)' if prompts.ndim == 0 else ''}")
    if not isinstance(prompts, Iterable):
        raise PromptError(f"prompts must be one prompt or a list of prompts, got {type(prompts).__name__}")


def to_prompt_ids(prompt, tokenizer) -> list[int]:
    """Token ids (Python ints) of one prompt in any form of ``PROMPT_FORMS``."""
    if is_vllm_prompt(prompt):
        prompt = unwrap_vllm_prompt(prompt)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise PromptError("prompt is text but the model has no tokenizer; pass token ids")
        _check_unicode("prompt", prompt)
        return _tokenizer_call("the tokenizer could not encode the prompt", tokenizer.encode, prompt) if prompt else []
    if is_token_ids(prompt):
        return [int(t) for t in (prompt.tolist() if _is_array(prompt) else prompt)]
    if is_chat(prompt):
        return chat_ids(prompt, tokenizer)
    raise PromptError(f"prompt must be {PROMPT_FORMS}, got {_describe(prompt)}")


def chat_ids(messages: list[dict], tokenizer) -> list[int]:
    """Render messages with the tokenizer's chat template (generation prompt added); a message's content is a string
    or a list of text parts (``message_text``)."""
    texts = []
    for i, m in enumerate(messages):
        texts.append(chat_message_text(m, i))
        _check_unicode(f"messages[{i}].role", m["role"])
        _check_unicode(f"messages[{i}].content", texts[-1])
    messages = [m if m["content"] is text else {**m, "content": text} for m, text in zip(messages, texts)]
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise PromptError("prompt is a chat but the tokenizer has no chat template")
    text = _tokenizer_call("the chat template refused the messages", tokenizer.apply_chat_template, messages,
                           tokenize=False, add_generation_prompt=True)
    return _tokenizer_call("the tokenizer could not encode the chat", tokenizer.encode, text, add_special_tokens=False)


def chat_message_text(message, i: int) -> str:
    """The text of ``messages[i]`` (``message_text`` of its content), once it is checked to be an object with a
    string 'role' and a 'content' (a PromptError naming ``messages[i]`` otherwise)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(
            message.get("content"), (str, list)):
        raise PromptError(f"messages[{i}] must be an object with a string 'role' and a 'content' (a string or a list "
                          f"of text parts)", f"messages[{i}]")
    return message_text(message["content"], f"messages[{i}].content")


def message_text(content: str | list, where: str = "content") -> str:
    """A chat message's text: its string content, or its content parts (OpenAI's ``[{"type": "text", "text": ...}]``,
    which clients send for text too) joined with newlines, as vLLM joins them. An empty list, or a part of another
    type (an image, audio: the models here read text only), is a PromptError naming it (``where``: the content's
    name in the request)."""
    if isinstance(content, str):
        return content
    if not content:
        raise PromptError(f"{where} is an empty list of parts", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            shown = repr(kind if isinstance(kind, str) else part)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise PromptError(f"{at} must be a text part {{\"type\": \"text\", \"text\": ...}}, got {shown}: the "
                              f"models here read text only", at)
        if not isinstance(part.get("text"), str):
            raise PromptError(f"{at} is a text part without a string 'text'", at)
        texts.append(part["text"])
    return "\n".join(texts)


def _check_unicode(name: str, text: str) -> None:
    """PromptError naming ``name`` when ``text`` cannot be encoded as UTF-8 (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise PromptError(f"{name} is not valid Unicode: lone surrogate {text[err.start]!r} at character "
                          f"{err.start}") from None


def _tokenizer_call(what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` of the tokenizer (as a list when it returns token ids). A template or tokenizer
    that raises (a chat template's ``raise_exception``, any error of its own) is the prompt's fault: a
    PromptError saying ``what`` and why."""
    try:
        out = fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - user-supplied templates and third-party tokenizers raise anything
        raise PromptError(f"{what}: {type(err).__name__}: {err}") from err
    return out if isinstance(out, str) else list(out)


def _is_int(t) -> bool:
    # ``type(t) is int`` first: prompts are Python ints almost always, and the ABC check costs ~3 us a token
    return type(t) is int or (isinstance(t, numbers.Integral) and not isinstance(t, bool))


def _is_array(x) -> bool:
    """A torch tensor or a numpy array (duck-typed: no numpy import needed)."""
    return hasattr(x, "ndim") and hasattr(x, "dtype") and hasattr(x, "tolist")


def _integer_dtype(x) -> bool:
    import torch

    if isinstance(x, torch.Tensor):
        return not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool
    return getattr(x.dtype, "kind", "") in ("i", "u")


def _describe(x) -> str:
    if _is_array(x):
        return f"{type(x).__name__} of shape {tuple(x.shape)} and dtype {x.dtype}"
    if isinstance(x, (list, tuple)) and x:
        kinds = sorted({type(t).__name__ for t in x})
        return f"{type(x).__name__} of {'/'.join(kinds)}"
    return type(x).__name__
