"""Token files for eagle-draft training: whole ShareGPT conversations as compact token ids.

``build_token_file`` renders each *train*-split conversation (index % 20 != 0) with the target's
chat template, tokenises it (truncated to ``max_len`` tokens) and marks the tokens that belong to
assistant turns. The file is an uncompressed ``.npz``: ``tokens`` (uint16, all conversations back
to back), ``offsets`` (int64, conversation starts plus the end), ``assistant`` (the assistant
mask, bit-packed) and ``meta`` (a JSON string). It is small enough to carry to a GPU machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


def conversation_messages(conv: dict) -> list[dict] | None:
    """Chat messages of a ShareGPT conversation from its first user/system turn up to its first
    malformed turn; None without an assistant reply after a user turn."""
    out: list[dict] = []
    for turn in (conv.get("conversations") if isinstance(conv, dict) else None) or ():
        role = ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        text = turn.get("value") if isinstance(turn, dict) else None
        if role is None or not isinstance(text, str) or not text.strip():
            break
        out.append({"role": role, "content": text})
    roles = [m["role"] for m in out]
    if "user" not in roles or "assistant" not in roles[roles.index("user"):]:
        return None
    first = next(i for i, r in enumerate(roles) if r in ("user", "system"))
    return out[first:]


def render_with_spans(messages: list[dict], tokenizer, max_chars: int) -> tuple[str, list[tuple[int, int]]]:
    """The chat-template text of ``messages`` (stopping once it is ``max_chars`` long) and the
    character spans of the assistant turns (each from after its header to the end of its turn)."""
    text, spans = "", []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            head = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not full.startswith(text):  # a template that rewrites earlier turns: keep what is consistent
            break
        if m["role"] == "assistant" and full.startswith(head):
            spans.append((len(head), len(full)))
        text = full
        if len(text) >= max_chars:
            break
    return text, spans


def tokenize_conversation(messages: list[dict], tokenizer, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (uint16) of the rendered conversation, at most ``max_len``, and its assistant mask."""
    text, spans = render_with_spans(messages, tokenizer, max_chars=12 * max_len)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"][:max_len], dtype=np.int64)
    if ids.size and ids.max() >= 2**16:
        raise ValueError(f"token id {int(ids.max())} does not fit uint16 (vocabulary must be <= 65536)")
    starts = np.asarray([s for s, _ in enc["offset_mapping"][:max_len]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    return ids.astype(np.uint16), mask


@dataclass(frozen=True)
class TokenFile:
    """A loaded token file: conversation ``i`` is ``tokens[offsets[i]:offsets[i+1]]``."""

    tokens: np.ndarray  # (total,) uint16
    offsets: np.ndarray  # (num_docs + 1,) int64
    assistant: np.ndarray  # (total,) bool
    meta: dict

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    def doc(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (int64) and assistant mask of conversation ``i``."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b].astype(np.int64), self.assistant[a:b]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def save_token_file(path: str | Path, docs: list[tuple[np.ndarray, np.ndarray]], meta: dict) -> Path:
    """Write conversations ``docs`` ((ids, mask) pairs) as a token file; returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = np.concatenate([d[0] for d in docs]).astype(np.uint16)
    mask = np.concatenate([d[1] for d in docs]).astype(bool)
    offsets = np.concatenate([[0], np.cumsum([len(d[0]) for d in docs])]).astype(np.int64)
    with path.open("wb") as fp:
        np.savez(fp, tokens=tokens, offsets=offsets, assistant=np.packbits(mask),
                 meta=np.asarray(json.dumps(meta)))
    return path


def load_token_file(path: str | Path) -> TokenFile:
    """Read a token file written by ``save_token_file``."""
    with np.load(Path(path), allow_pickle=False) as z:
        tokens, offsets = z["tokens"], z["offsets"]
        mask = np.unpackbits(z["assistant"], count=len(tokens)).astype(bool)
        meta = json.loads(str(z["meta"]))
    if offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) < 1):
        raise ValueError(f"{path}: offsets do not partition the {len(tokens)} tokens into non-empty conversations")
    return TokenFile(tokens, offsets, mask, meta)


def load_token_files(paths: str) -> TokenFile:
    """The token files ``paths`` (one path, or several joined by commas) as one: their conversations in order (the
    validation tail is the last file's). Several files' ``meta`` is ``{"files": [each file's meta], "num_docs",
    "num_tokens"}`` (and ``prompts_only`` when any file holds prompts only)."""
    names = [p.strip() for p in str(paths).split(",")]
    if not all(names):
        raise ValueError(f"--tokens {paths!r}: an empty file name between commas")
    files = [load_token_file(p) for p in names]
    if len(files) == 1:
        return files[0]
    sizes = np.cumsum([0] + [len(f.tokens) for f in files[:-1]])
    offsets = np.concatenate([files[0].offsets[:1]] + [f.offsets[1:] + s for f, s in zip(files, sizes)])
    meta = {"files": [f.meta for f in files], "num_docs": len(offsets) - 1, "num_tokens": int(offsets[-1])}
    if any(f.meta.get("prompts_only") for f in files):
        meta["prompts_only"] = True
    return TokenFile(np.concatenate([f.tokens for f in files]), offsets, np.concatenate([f.assistant for f in files]),
                     meta)


def build_token_file(path: str | Path, tokenizer, split: str, max_tokens: int, max_len: int,
                     sharegpt_path: str | Path | None = None, target: str = "") -> TokenFile:
    """Tokenise ShareGPT ``split`` conversations in file order until ``max_tokens`` tokens; write and
    return the token file."""
    from tqdm.auto import tqdm

    from specdec.benchmark.data import iter_sharegpt

    docs, total, indices = [], 0, []
    with tqdm(total=max_tokens, desc=f"tokenise sharegpt-{split}", unit="tok") as bar:
        for index, conv in iter_sharegpt(split, path=sharegpt_path):
            messages = conversation_messages(conv)
            if messages is None:
                continue
            ids, mask = tokenize_conversation(messages, tokenizer, max_len)
            if len(ids) < 2 or not mask.any():
                continue
            docs.append((ids, mask))
            indices.append(index)
            total += len(ids)
            bar.update(len(ids))
            if total >= max_tokens:
                break
    if not docs:
        raise ValueError(f"no usable ShareGPT {split} conversation found")
    meta = {"source": f"ShareGPT V3 {split} split (index % 20 {'!=' if split == 'train' else '=='} 0), "
                      "whole conversations, chat template", "split": split, "target": target,
            "max_len": max_len, "num_docs": len(docs), "num_tokens": total,
            "first_index": indices[0], "last_index": indices[-1]}
    save_token_file(path, docs, meta)
    return load_token_file(path)


def top_vocab(tokens: np.ndarray, vocab_size: int, n: int) -> np.ndarray:
    """The ``n`` most frequent ids of ``tokens`` (ties by id), sorted ascending: a draft vocabulary."""
    counts = np.bincount(tokens.astype(np.int64), minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))[:n]
    return np.sort(order)


def coverage(tokens: np.ndarray, vocab_ids: np.ndarray) -> float:
    """Fraction of ``tokens`` that lie in ``vocab_ids``."""
    return float(np.isin(tokens, vocab_ids).mean()) if len(tokens) else float("nan")
