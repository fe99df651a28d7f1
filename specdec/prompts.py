"""Turning a user's prompt (text, token ids or chat messages) into token ids."""

from __future__ import annotations


class PromptError(ValueError):
    """A prompt that cannot be run; the message names the problem and the allowed range."""


def to_prompt_ids(prompt, tokenizer) -> list[int]:
    """Token ids of a text prompt, a list of token ids, or a chat (list of {role, content})."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise PromptError("prompt is text but the model has no tokenizer; pass token ids")
        return list(tokenizer.encode(prompt)) if prompt else []
    if isinstance(prompt, (list, tuple)):
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if all(isinstance(m, dict) for m in prompt):
            return chat_ids(prompt, tokenizer)
    raise PromptError(f"prompt must be a str, a list of token ids or a list of chat messages, got "
                      f"{type(prompt).__name__}")


def chat_ids(messages: list[dict], tokenizer) -> list[int]:
    """Render messages with the tokenizer's chat template (generation prompt added)."""
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise PromptError(f"messages[{i}] needs string 'role' and 'content'")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise PromptError("prompt is a chat but the tokenizer has no chat template")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))
