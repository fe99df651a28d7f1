"""Regenerated token files: the same conversations, with every assistant reply written by the target.

``regenerate_token_file`` reads a token file (``training.eagle_data``), keeps each conversation's
user turns (and system turn) as they are and replaces its assistant replies, one turn after the
other, with what the target alone generates for the conversation so far, once per asked temperature
(0: greedy), so the draft learns the contexts of greedy and of sampled requests. The target's tokens are
the loss-masked tokens of the new file; the end-of-turn tokens that close a reply the target did not
end itself, and the newline after each reply, stay unmasked context. ``cut_token_file`` writes the
original text of the same conversations cut to the same turns, so the two files differ only in who
wrote the replies. ``prompt_token_file`` keeps only what regeneration reads (the user turns and each
reply's closing tokens): a far smaller file to carry to the machine that regenerates.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specdec.training.eagle_data import TokenFile, load_token_file, save_token_file


@dataclass(frozen=True)
class RegenConfig:
    """How replies are regenerated. ``max_len``: a turn is generated only if the conversation so far
    plus ``max_new_tokens`` fits (None: the source file's ``max_len``). ``temperatures``: one new conversation per
    source conversation and temperature (0: greedy; sampled ones use ``top_p``). ``time_budget``: no new chunk of
    ``chunk`` source conversations starts once it would end past these seconds (None: no limit). ``first_doc``: the
    source conversation to start at (a later run regenerates the ones an earlier run did not reach: its file's
    ``source_docs`` end below it)."""

    max_new_tokens: int = 256
    temperatures: tuple[float, ...] = (0.7,)
    top_p: float = 0.9
    seed: int = 0
    max_turns: int = 1
    max_docs: int | None = None
    max_len: int | None = None
    chunk: int = 512
    time_budget: float | None = None
    first_doc: int = 0

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "max_turns", "chunk"):
            _require(_is_int(getattr(self, name)) and getattr(self, name) >= 1, name, "an int >= 1",
                     getattr(self, name))
        for name in ("max_docs", "max_len"):
            value = getattr(self, name)
            _require(value is None or (_is_int(value) and value >= 1), name, "None or an int >= 1", value)
        object.__setattr__(self, "temperatures", tuple(self.temperatures))
        _require(len(self.temperatures) >= 1 and all(t >= 0 for t in self.temperatures), "temperatures",
                 "one or more numbers >= 0 (0 = greedy)", self.temperatures)
        _require(0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        _require(_is_int(self.seed) and self.seed >= 0, "seed", "an int >= 0", self.seed)
        _require(self.time_budget is None or self.time_budget > 0, "time_budget", "None or seconds > 0",
                 self.time_budget)
        _require(_is_int(self.first_doc) and self.first_doc >= 0, "first_doc", "an int >= 0", self.first_doc)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"RegenConfig.{name} must be {rule}, got {value!r}")


def assistant_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of assistant tokens in a conversation's mask."""
    m = np.concatenate([[False], np.asarray(mask, dtype=bool), [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(m))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


@dataclass
class _Doc:
    """One conversation being rewritten: its source, the new tokens so far and the next turn."""

    index: int
    ids: np.ndarray  # source tokens
    runs: list[tuple[int, int]]  # source assistant runs
    out: list[int]
    mask: list[bool]
    turn: int = 0  # the source turn generated next; -1 once finished
    replies: int = 0
    variant: int = 0  # which of the config's temperatures writes the replies


def _turn_end(ids: np.ndarray, run: tuple[int, int], eos: set[int]) -> list[int] | None:
    """The source reply's closing tokens (its last EOS and what follows it in the run), None if it
    has no EOS (cut by the source's max_len: the conversation cannot go on)."""
    at = [p for p in range(run[0], run[1]) if int(ids[p]) in eos]
    return None if not at else ids[at[-1]:run[1]].tolist()


def _append_reply(doc: _Doc, gen: list[int], eos: set[int], cfg: RegenConfig, max_len: int) -> None:
    """Add the generated reply (masked); if another source turn follows and fits, add the turn end
    and the next user turn (unmasked) and move on to it, else mark the conversation finished."""
    doc.out += gen
    doc.mask += [True] * len(gen)
    doc.turn += 1
    doc.replies += 1
    end = _turn_end(doc.ids, doc.runs[doc.turn - 1], eos)
    if doc.turn >= min(cfg.max_turns, len(doc.runs)) or end is None:
        doc.turn = -1
        return
    closing = end[1:] if gen and gen[-1] in eos else end
    user = doc.ids[doc.runs[doc.turn - 1][1]:doc.runs[doc.turn][0]].tolist()
    if len(doc.out) + len(closing) + len(user) + cfg.max_new_tokens > max_len:
        doc.turn = -1
        return
    doc.out += closing + user
    doc.mask += [False] * (len(closing) + len(user))


def _params(cfg: RegenConfig, doc: _Doc):
    from specdec.sampling_params import SamplingParams

    seed = ((cfg.seed * 1_000_003 + doc.index) * 64 + doc.turn) * 16 + doc.variant  # the same whatever the chunking
    t = cfg.temperatures[doc.variant]
    return SamplingParams(temperature=t, top_p=cfg.top_p if t else 1.0, seed=seed, max_new_tokens=cfg.max_new_tokens)


def eos_ids(tokenizer, config=None) -> set[int]:
    """The end-of-turn ids of a target (its config's EOS ids and its tokenizer's); ValueError when there is none."""
    eos = set(config.eos_token_ids) if config is not None else set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    if not eos:
        raise ValueError("the target has no EOS token id: a reply's end cannot be found")
    return eos


def regenerate_token_file(target, src: str | Path | TokenFile, out_path: str | Path,
                          cfg: RegenConfig | None = None, engine_config=None,
                          started: float | None = None) -> TokenFile:
    """Write (and return) a token file of ``src``'s conversations, in order, whose assistant replies
    are the target's own (``SpecEngine`` target-only, ``engine_config`` a ``SpecConfig``).

    A conversation is kept when its first reply fits (prompt + ``max_new_tokens`` <= max_len); later
    turns follow while they fit, up to ``cfg.max_turns``. Each kept conversation appears once per temperature
    of ``cfg``, side by side. ``meta["source_docs"]``, ``meta["turns"]`` and ``meta["temperatures"]`` say which
    source conversation each new one is, how many replies it has and at which temperature they were written.
    ``started``: the ``time.perf_counter()`` from which ``cfg.time_budget`` counts (default: when generation starts;
    a caller that loaded the target gives its own start, so that loading and the engine's warm-up count too)."""
    from tqdm.auto import tqdm

    from specdec.engine import SpecConfig, SpecEngine

    cfg = cfg or RegenConfig()
    data = src if isinstance(src, TokenFile) else load_token_file(src)
    max_len = cfg.max_len or int(data.meta.get("max_len", 1024))
    eos = eos_ids(target.tokenizer, target.config)
    todo = []
    end = data.num_docs if cfg.max_docs is None else min(cfg.first_doc + cfg.max_docs, data.num_docs)
    for i in range(cfg.first_doc, end):
        ids, mask = data.doc(i)
        runs = assistant_runs(mask)
        if runs and 0 < runs[0][0] <= max_len - cfg.max_new_tokens:
            todo += [_Doc(i, ids, runs, ids[:runs[0][0]].tolist(), [False] * runs[0][0], variant=v)
                     for v in range(len(cfg.temperatures))]
    if not todo:
        raise ValueError(f"no conversation of the source from number {cfg.first_doc} on (of {data.num_docs}) has a "
                         f"first user turn of <= {max_len - cfg.max_new_tokens} tokens (max_len - max_new_tokens)")
    engine = SpecEngine(None, target, engine_config or SpecConfig())
    t0, done, finish = time.perf_counter(), [], {}
    chunk_docs = cfg.chunk * len(cfg.temperatures)
    interrupted = False
    with tqdm(total=len(todo), desc="regenerate replies", unit="conv") as bar:
        try:
            for c in range(0, len(todo), chunk_docs):
                now = time.perf_counter()
                per_chunk = (now - t0) / (c // chunk_docs) if c else 0.0
                if cfg.time_budget is not None and c and now - (started or t0) + per_chunk > cfg.time_budget:
                    break
                chunk = todo[c:c + chunk_docs]
                while active := [d for d in chunk if d.turn >= 0]:  # one round per turn
                    outs = engine.generate([d.out for d in active], [_params(cfg, d) for d in active])
                    for d, o in zip(active, outs):
                        if o.error is not None:
                            raise o.error
                        finish[o.finish_reason] = finish.get(o.finish_reason, 0) + 1
                        _append_reply(d, list(o.token_ids), eos, cfg, max_len)
                done += chunk
                bar.update(len(chunk))
        except KeyboardInterrupt:  # (the CLI turns SIGTERM into this): the finished chunks are still written
            if not done:
                raise
            interrupted = True
            print(f"distill: regeneration interrupted; writing the {len(done)} conversations of finished chunks",
                  flush=True)
    seconds = time.perf_counter() - t0
    docs = [(np.asarray(d.out, dtype=np.uint16), np.asarray(d.mask, dtype=bool)) for d in done]
    generated = int(sum(m.sum() for _, m in docs))
    per_t = {str(t): sum(d.variant == v for d in done) for v, t in enumerate(cfg.temperatures)}
    kept = {k: v for k, v in data.meta.items() if k != "prompts_only"}
    meta = {**kept, "source": f"{data.meta.get('source', 'token file')}; assistant replies regenerated by "
                                   "the target", "target": target.name, "max_len": max_len,
            "num_docs": len(docs), "num_tokens": int(sum(len(i) for i, _ in docs)),
            "regenerated": {**asdict(cfg), "seconds": round(seconds, 2), "generated_tokens": generated,
                            "tokens_per_s": round(generated / max(seconds, 1e-9), 1), "finish": finish,
                            "source_docs_considered": len(todo) // len(cfg.temperatures), "interrupted": interrupted,
                            "docs_per_temperature": per_t},
            "source_docs": [d.index for d in done], "turns": [d.replies for d in done],
            "temperatures": [cfg.temperatures[d.variant] for d in done]}
    save_token_file(out_path, docs, meta)
    return load_token_file(out_path)


def cut_token_file(src: str | Path | TokenFile, out_path: str | Path, docs: list[int],
                   turns: list[int]) -> TokenFile:
    """Write (and return) source conversations ``docs``, each cut after its ``turns[i]``-th assistant
    reply: the original text of what ``regenerate_token_file`` rewrote."""
    data = src if isinstance(src, TokenFile) else load_token_file(src)
    if len(docs) != len(turns) or not docs:
        raise ValueError(f"docs and turns must be non-empty and of one length, got {len(docs)} and {len(turns)}")
    out = []
    for i, k in zip(docs, turns):
        ids, mask = data.doc(i)
        runs = assistant_runs(mask)
        if not 1 <= k <= len(runs):
            raise ValueError(f"turns for conversation {i} must be in [1, {len(runs)}], got {k}")
        out.append((ids[:runs[k - 1][1]], mask[:runs[k - 1][1]]))
    meta = {**data.meta, "source": f"{data.meta.get('source', 'token file')}; cut to the regenerated turns",
            "num_docs": len(out), "num_tokens": int(sum(len(i) for i, _ in out)), "source_docs": list(docs),
            "turns": list(turns)}
    save_token_file(out_path, out, meta)
    return load_token_file(out_path)


def prompt_token_file(src: str | Path | TokenFile, out_path: str | Path, eos: set[int], max_turns: int) -> TokenFile:
    """Write (and return) what ``regenerate_token_file`` reads of ``src``: every conversation, in order, cut after
    its ``max_turns``-th reply, each reply reduced to its closing tokens (its last EOS and what follows it); a reply
    without an EOS (cut by the source's max_len) keeps its first token and ends the conversation. Regenerating at
    most ``max_turns`` turns from this file gives what regenerating from ``src`` gives."""
    data = src if isinstance(src, TokenFile) else load_token_file(src)
    if not (_is_int(max_turns) and max_turns >= 1):
        raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
    docs = []
    for i in range(data.num_docs):
        ids, mask = data.doc(i)
        out_ids, out_mask, prev = [], [], 0
        for a, b in assistant_runs(mask)[:max_turns]:
            end = _turn_end(ids, (a, b), eos)
            reply = ids[a:a + 1].tolist() if end is None else end
            out_ids += ids[prev:a].tolist() + reply
            out_mask += [False] * (a - prev) + [True] * len(reply)
            prev = b
            if end is None:
                break
        docs.append((np.asarray(out_ids or ids.tolist(), dtype=np.uint16),
                     np.asarray(out_mask or mask.tolist(), dtype=bool)))
    meta = {**data.meta, "source": f"{data.meta.get('source', 'token file')}; replies cut to their closing tokens "
                                   f"(prompts for regenerating up to {max_turns} turns)", "prompts_only": True,
            "num_docs": len(docs), "num_tokens": int(sum(len(d) for d, _ in docs))}
    save_token_file(out_path, docs, meta)
    return load_token_file(out_path)
