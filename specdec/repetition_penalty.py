"""The inputs of the logit penalties at the verify tokens of a step (``SamplingParams.repetition_penalty``,
``presence_penalty`` and ``frequency_penalty``), and of the request's logits processors (``logit_bias``,
``allowed_token_ids``, ``bad_words``, ``min_tokens``).

The penalty of a token depends on its context: at verify token j of a row (0 the root, the pending token) the
context is the request's tokens (prompt and committed output, the pending token included) plus the draft tokens
on j's path (its ancestors and j itself). So every verify token gets its own penalty inputs: the row's host
context (``ContextPenalty``, (B, V) tensors copied to the device) joined on the device with the path tokens that
the tree masks select. The repetition penalty reads which tokens the prompt and output hold, the presence and
frequency penalties how often each token occurs in the output alone (as in vLLM). ``min_tokens`` depends on j's
depth: the token chosen after j is output token ``len(output) + depth(j)``, and the row's ending tokens are held
back there while that is below ``min_tokens``. A bad word's last token is banned at j where the output up to j (the
committed tail, then j's path by depth) ends with the rest of the word. As in vLLM, the bias and the banned tokens
apply to the raw logits first, then the rules apply the penalties (``acceptance.repetition_penalty``, then
``acceptance.count_penalty``), then shaping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from specdec.kernels.arg_checks import FLOAT_DTYPES
from specdec.kernels.logit_processors import processed_logits_reference, processed_logits_triton


class OutputCounts(NamedTuple):
    """Each row's presence and frequency penalties and its committed output's token counts, on the device."""

    counts: Tensor  # (B, V) float32: the token's occurrences in the row's output so far
    presence: Tensor  # (B,) float32; 0 = off
    frequency: Tensor  # (B,) float32; 0 = off


class HeldBack(NamedTuple):
    """Each row's ending tokens and how many more output tokens must come before them (``min_tokens``)."""

    tokens: Tensor  # (B, V) bool: the tokens that end the row (its EOS unless ignore_eos, its stop_token_ids)
    left: Tensor  # (B,) int64: min_tokens less the row's output so far (<= 0: none held back)


class BadWords(NamedTuple):
    """Each row's bad words (token sequences, right-aligned) and the tail of its committed output, on the device."""

    tail: Tensor  # (B, W) int64: the row's last W output tokens, -1 before its output's start
    words: Tensor  # (B, N, W + 1) int64: a word's leading tokens right-aligned in the first W columns (WILDCARD
    #                before them), the token it bans last (-1: no word)


WILDCARD = -2  # a bad word's column before its leading tokens: any token (or none) matches it


class ContextPenalty(NamedTuple):
    """Each row's penalties and the tokens of its committed context, and its logits processors, on the device."""

    present: Tensor | None  # (B, V) bool: the token is in the row's prompt or output so far; None: no row has a
    penalty: Tensor | None  # (B,) float32 repetition penalty; 1 = off                      repetition penalty
    output: OutputCounts | None = None  # None: no row has a presence or frequency penalty
    bias: Tensor | None = None  # (B, V) float32 added to the raw logits (logit_bias; -inf outside allowed_token_ids)
    held: HeldBack | None = None  # None: no row holds its ending tokens back
    bad: BadWords | None = None  # None: no row has bad words

    @staticmethod
    def of(reqs: Sequence, rows: Sequence[int], b: int, vocab: int, device: torch.device | str,
           ahead: tuple[Tensor, Tensor] | None = None, state: ContextState | None = None) -> ContextPenalty:
        """The penalties and processors of rows ``rows`` of ``reqs`` (each a ``Request``: ``tokens``,
        ``output_ids``, ``num_output``, ``eos_token_ids`` and ``params``; with ``state``, ``bt_row`` too) in a batch
        of ``b`` rows; other rows are unchanged. The (B, V) tensors are made on the device from the rows' token ids
        (one small copy each, not a host array of the whole vocabulary per row), or with ``state`` gathered from the
        rows' contexts kept there (``ContextState``: only the tokens committed since the last step are sent; the
        other rows of the batch then hold some context, which their neutral penalties leave unread). ``ahead``: what
        each row commits in the step in flight, which the host has not read (``committed_ahead``; ``after``)."""
        params = {i: reqs[i].params for i in rows}
        present = penalty = output = bias = held = None
        repeated = [i for i in rows if params[i].repetition_penalty != 1.0]
        counted = [i for i in rows if params[i].presence_penalty or params[i].frequency_penalty]
        kept = state.rows_of(reqs, repeated, counted, b, vocab) if state is not None and (repeated or counted) else None
        if repeated:
            present = kept[0] if kept else _dense_rows(b, vocab, {i: reqs[i].tokens for i in repeated}, torch.bool,
                                                       device)
            penalty = np.ones(b, dtype=np.float32)
            penalty[repeated] = [params[i].repetition_penalty for i in repeated]
            penalty = _on_device(penalty, device)
        if counted:
            output = _output_counts(reqs, counted, b, vocab, device, kept[1] if kept else None)
        biased = [i for i in rows if params[i].logit_bias or params[i].allowed_token_ids is not None]
        if biased:
            bias = (state.bias_of(reqs, biased, b, vocab) if state is not None
                    else _bias_rows([params[i] for i in biased], biased, b, vocab, device))
        early = [i for i in rows if reqs[i].num_output < params[i].min_tokens]
        if early:
            held = _held_back([reqs[i] for i in early], early, b, vocab, device)
        worded = [i for i in rows if reqs[i].bad_word_ids]
        bad = _bad_words([reqs[i] for i in worded], worded, b, vocab, device) if worded else None
        out = ContextPenalty(present, penalty, output, bias, held, bad)
        if ahead is None:
            return out
        tokens, counts = ahead  # (the batch's rows past them commit none)
        if tokens.shape[0] < b:
            tokens = torch.cat([tokens, tokens.new_full((b - tokens.shape[0], tokens.shape[1]), -1)])
            counts = torch.cat([counts, counts.new_zeros(b - counts.shape[0])])
        return out.after(tokens, counts)

    def after(self, tokens: Tensor, counts: Tensor) -> ContextPenalty:
        """This context once each row has also committed ``tokens`` (B, K) int64, its first ``counts[i]`` (B,)
        (-1 after them): the tokens of a step still in flight, on the device only (``committed_ahead``), for the rule
        of the step queued behind it. They join the prompt and output (``present``), the output's counts and the
        tail that bad words match, and ``min_tokens`` waits for that many fewer."""
        present, output, held, bad = self.present, self.output, self.held, self.bad
        if present is not None:
            present = _plus_tokens(present, tokens, True)
        if output is not None:
            output = output._replace(counts=_plus_tokens(output.counts, tokens, 1.0))
        if held is not None:
            held = held._replace(left=held.left - counts)
        if bad is not None:
            w = bad.tail.shape[1]
            joined = torch.cat([bad.tail, tokens], 1)  # (B, W + K): the last W up to each row's count
            tail = joined.gather(1, counts.view(-1, 1) + torch.arange(w, device=tokens.device))
            bad = bad._replace(tail=tail)
        return self._replace(present=present, output=output, held=held, bad=bad)

    def tensors(self) -> list[Tensor | None]:
        """Its device tensors in a fixed order (None where a part is off)."""
        out, held, bad = self.output, self.held, self.bad
        return [self.present, self.penalty, *(out or (None,) * 3), self.bias, *(held or (None,) * 2),
                *(bad or (None,) * 2)]

    @property
    def layout(self) -> tuple:
        """Which parts it has and their shapes: a graph captured over one reads another of the same layout."""
        return tuple(None if t is None else (tuple(t.shape), t.dtype) for t in self.tensors())

    def cloned(self) -> ContextPenalty:
        """A copy of its tensors, to be the fixed inputs of a graph (``copy_from`` refills them)."""
        t = [None if x is None else x.clone() for x in self.tensors()]
        return ContextPenalty(t[0], t[1], None if t[2] is None else OutputCounts(*t[2:5]), t[5],
                              None if t[6] is None else HeldBack(*t[6:8]), None if t[8] is None else BadWords(*t[8:]))

    def copy_from(self, other: ContextPenalty) -> None:
        """Its tensors overwritten with ``other``'s (of the same ``layout``)."""
        for mine, theirs in zip(self.tensors(), other.tensors()):
            if mine is not None:
                mine.copy_(theirs)

    def apply(self, logits: Tensor, tokens: Tensor, tree_mask: Tensor, use_triton: bool = False) -> Tensor:
        """(B, Q, V) float32-or-wider logits at the verify tokens (B, Q) with each one's processors and penalties
        applied: the bias and the held-back and banned tokens, then the repetition penalty, then the frequency and
        presence penalties, each verify token's context the row's plus its path (its draft ancestors and itself;
        the root's bit of its tree mask (B, Q) is not read: the pending token is in the row's context already).
        ``use_triton``: in one launch (``kernels.logit_processors``; the same bits as its torch reference)."""
        held, bad, out = self.held, self.bad, self.output
        parts = dict(bias=self.bias, present=self.present, penalty=self.penalty)
        nodes = path_nodes(tree_mask)  # (B, Q, Q)
        depth = path_depth(tree_mask) if held is not None or bad is not None else None  # (B, Q)
        if held is not None:
            parts.update(held=held.tokens, early=depth < held.left.view(-1, 1))
        if bad is not None:
            parts.update(banned=self.banned_ids(tokens, nodes, depth))
        if out is not None:
            parts.update(counts=out.counts, presence=out.presence, frequency=out.frequency)
        path = torch.where(nodes, tokens.unsqueeze(1), -1)  # (B, Q, Q): j's path tokens
        if use_triton and logits.dtype in FLOAT_DTYPES:
            return processed_logits_triton(logits, path, **parts)
        return processed_logits_reference(logits, path, **parts)

    def banned_ids(self, tokens: Tensor, nodes: Tensor, depth: Tensor) -> Tensor:
        """(B, Q, N) int64: at each verify token (B, Q), the last token of every bad word whose leading tokens end
        the output there (the committed tail, then the tokens of its path by depth); -1 where a word does not.
        ``nodes`` (B, Q, Q) and ``depth`` (B, Q): the tree's ``path_nodes`` and ``path_depth``."""
        b, q = tokens.shape
        tail, words = self.bad
        w = tail.shape[1]
        at = torch.where(nodes, (depth - 1).unsqueeze(1), q)  # (B, Q, Q): i's place in j's path
        path = torch.full((b, q, q + 1), -1, dtype=torch.int64, device=tokens.device)
        path.scatter_(-1, at, tokens.unsqueeze(1).expand(b, q, q))  # (B, Q, Q + 1): j's path tokens by depth
        seq = torch.cat([tail.unsqueeze(1).expand(b, q, w), path[..., :q - 1]], -1)  # (B, Q, W + Q - 1)
        ends = depth.clamp(min=0).unsqueeze(-1) + torch.arange(w, device=tokens.device)  # (B, Q, W)
        window = seq.gather(-1, ends)  # (B, Q, W): the output's last W tokens up to j
        lead, last = words[..., :w].unsqueeze(1), words[..., w]  # (B, 1, N, W), (B, N)
        match = ((window.unsqueeze(2) == lead) | (lead == WILDCARD)).all(-1) & (last >= 0).unsqueeze(1)  # (B,Q,N)
        return torch.where(match, last.unsqueeze(1), -1)


def _plus_tokens(dense: Tensor, tokens: Tensor, value) -> Tensor:
    """``dense`` (B, V) with ``value`` set (bool) or added (per occurrence) at each row's ``tokens`` (B, K) >= 0."""
    vocab = dense.shape[1]
    out = torch.cat([dense, dense.new_zeros(dense.shape[0], 1)], 1)  # (column V: the -1 padding's)
    where = torch.where(tokens >= 0, tokens, vocab)
    if dense.dtype == torch.bool:
        return out.scatter_(1, where, True)[:, :vocab]
    return out.scatter_add_(1, where, torch.full(where.shape, value, dtype=out.dtype, device=out.device))[:, :vocab]


@torch.inference_mode()
def committed_ahead(outcome: Tensor, ids: Tensor, rows: int, sel: np.ndarray | None,
                    joined: int = 0) -> tuple[Tensor, Tensor]:
    """The tokens a launched verify commits in each row that goes on, on the device, before the host reads them:
    ((R, Q + 1) int64, its accepted path's tokens then its bonus token, -1 after them; (R,) their counts). From the
    verify's ``outcome`` (rows in its order: [m, bonus, path (query indices)..., ...]) and its input ids (B, Q);
    the rows that go on are its first ``rows``, or its rows ``sel``; ``joined`` rows after them (their prefill just
    ended: their pending token is their own already) commit none."""
    q, dev = ids.shape[1], ids.device
    src = torch.arange(rows, device=dev) if sel is None else _on_device(np.asarray(sel, dtype=np.int64), dev)
    acc = outcome.index_select(0, src).long()  # (R, C)
    m = acc[:, :1]
    toks = ids.index_select(0, src).long().gather(1, acc[:, 2:2 + q].clamp(0, q - 1))  # (R, Q)
    toks = torch.cat([toks, toks.new_zeros(toks.shape[0], 1)], 1).scatter_(1, m, acc[:, 1:2])  # bonus at column m
    toks = torch.where(torch.arange(q + 1, device=dev) <= m, toks, -1)
    counts = m.view(-1) + 1
    if joined:
        toks = torch.cat([toks, toks.new_full((joined, q + 1), -1)])
        counts = torch.cat([counts, counts.new_zeros(joined)])
    return toks, counts


def _mask_bits(tree_mask: Tensor) -> Tensor:
    """(B, Q, Q) int64: [b, j, i] bit i of verify token j's tree mask (B, Q) (token i is on j's path, the root's
    bit 0 included)."""
    return (tree_mask.unsqueeze(-1) >> torch.arange(tree_mask.shape[-1], device=tree_mask.device)) & 1


def path_depth(tree_mask: Tensor) -> Tensor:
    """(B, Q) int64 depth of each verify token from its tree mask (B, Q): the bits set less one (the root 0; a
    padding token's empty mask -1)."""
    return _mask_bits(tree_mask).sum(-1) - 1


def path_nodes(tree_mask: Tensor) -> Tensor:
    """(B, Q, Q) bool: [b, j, i] draft token i (the root's bit 0 left out) is on verify token j's path."""
    bits = _mask_bits(tree_mask).bool()
    bits[..., 0] = False
    return bits


def _on_device(array: np.ndarray, device) -> Tensor:
    """``array`` on ``device``: on CUDA through pinned memory, a copy that does not wait for the stream's work so far
    (a verify in flight: a step queued behind it builds its rows' processors too)."""
    out = torch.from_numpy(array)
    return out.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else out


class ContextState:
    """The context of each block-table row's request on the device, kept across steps: which tokens its prompt and
    output hold (``present``, for repetition penalties) and how often each occurs in its output (``counts``, for
    presence and frequency penalties). Each is made at the first step that needs it, (rows, V): a bool and a float32
    tensor, so for a vocabulary of V a row costs 5 V bytes. A step sends only the tokens a row's request committed
    since it was last brought up to date, one copy for the batch; a row that another request took (a new one, or one
    preempted that got a row back) is cleared and rebuilt from its tokens. Building the (B, V) context from every
    row's whole token list at every step costs host time in proportion to the contexts' lengths (a batch of long
    chats pays milliseconds a step); kept, it costs the tokens committed since. A request's logit-bias row (its biases,
    -inf outside its allowed ids: an allowed set may hold thousands of ids) is made once too (``bias_of``)."""

    def __init__(self, rows: int, device: torch.device | str) -> None:
        self.rows, self.device = rows, torch.device(device)
        self.present: Tensor | None = None
        self.counts: Tensor | None = None
        self.owner: list = [None] * rows  # the request each row's context is of (compared by identity)
        self.bias: Tensor | None = None  # (rows + 1, V) float32: each row's request's logit-bias row; the last is 0
        self.bias_owner: list = [None] * rows
        self.synced = {"present": np.zeros(rows, dtype=np.int64), "counts": np.zeros(rows, dtype=np.int64)}

    def clear(self) -> None:
        """Drop every kept context and bias row (their memory too): the next step that needs one makes it anew."""
        self.__init__(self.rows, self.device)

    def rows_of(self, reqs: Sequence, repeated: Sequence[int], counted: Sequence[int], b: int,
                vocab: int) -> tuple[Tensor | None, Tensor | None]:
        """(present (b, V) for the batch rows ``repeated`` of ``reqs``, counts (b, V) for ``counted``): each brought
        up to date with its request's tokens, then gathered by its block-table row (rows of the batch outside the
        list, and padding rows, hold some other context)."""
        for name, which in (("present", repeated), ("counts", counted)):
            if which and getattr(self, name) is None:
                setattr(self, name, torch.zeros((self.rows, vocab), device=self.device,
                                                dtype=torch.bool if name == "present" else torch.float32))
        self._sync([reqs[i] for i in repeated], [reqs[i] for i in counted])
        where = np.zeros(b, dtype=np.int64)
        where[:len(reqs)] = [r.bt_row for r in reqs]
        where = _on_device(where, self.device)
        return (self.present.index_select(0, where) if repeated else None,
                self.counts.index_select(0, where) if counted else None)

    def bias_of(self, reqs: Sequence, biased: Sequence[int], b: int, vocab: int) -> Tensor:
        """(b, V) float32: the batch rows ``biased`` of ``reqs`` hold their request's bias row (``_bias_rows``: its
        logit biases, -inf outside its allowed ids), made once per request and kept in its block-table row (a
        request's bias does not change); the batch's other rows 0."""
        if self.bias is None:
            self.bias = torch.zeros((self.rows + 1, vocab), dtype=torch.float32, device=self.device)
        fresh = [i for i in biased if self.bias_owner[reqs[i].bt_row] is not reqs[i]]
        if fresh:
            made = _bias_rows([reqs[i].params for i in fresh], range(len(fresh)), len(fresh), vocab, self.device)
            at = _on_device(np.fromiter((reqs[i].bt_row for i in fresh), np.int64, len(fresh)), self.device)
            self.bias.index_copy_(0, at, made)
            for i in fresh:
                self.bias_owner[reqs[i].bt_row] = reqs[i]
        where = np.full(b, self.rows, dtype=np.int64)  # (the zero row)
        where[list(biased)] = [reqs[i].bt_row for i in biased]
        return self.bias.index_select(0, _on_device(where, self.device))

    def _sync(self, repeated: Sequence, counted: Sequence) -> None:
        """Send the tokens each request committed since its row was brought up to date: all of ``repeated``'s (prompt
        and output) to ``present``, ``counted``'s output tokens to ``counts``; in one copy."""
        parts: dict[str, list[np.ndarray]] = {"present": [], "counts": []}
        cleared = []
        for name, reqs in (("present", repeated), ("counts", counted)):
            synced = self.synced[name]
            for req in reqs:
                row, n = req.bt_row, len(req.tokens)
                if self.owner[row] is not req or n < synced[row]:  # (another request's row: both contexts cleared)
                    self.owner[row] = req
                    self.synced["present"][row] = self.synced["counts"][row] = 0
                    cleared.append(row)
                start = int(synced[row]) if name == "present" else max(int(synced[row]), req.num_prompt)
                if start < n:
                    parts[name].append(np.array([[row] * (n - start), req.tokens[start:n]], dtype=np.int64))
                synced[row] = n
        if cleared:
            rows = _on_device(np.asarray(cleared, dtype=np.int64), self.device)
            for t in (self.present, self.counts):
                if t is not None:
                    t.index_fill_(0, rows, 0)
        vocab = (self.present if self.present is not None else self.counts).shape[1]
        joined = {k: _in_vocab(np.concatenate(v, 1) if v else np.zeros((2, 0), dtype=np.int64), vocab)
                  for k, v in parts.items()}
        n_present = joined["present"].shape[1]
        if n_present + joined["counts"].shape[1] == 0:
            return
        pairs = _on_device(np.ascontiguousarray(np.concatenate([joined["present"], joined["counts"]], 1)), self.device)
        if n_present:
            _put(self.present, pairs[:, :n_present])
        if pairs.shape[1] > n_present:
            _put(self.counts, pairs[:, n_present:], count=True)


def _dense_rows(b: int, vocab: int, ids: dict[int, Sequence[int]], dtype: torch.dtype, device,
                count: bool = False) -> Tensor:
    """(b, vocab) tensor on ``device``: row i set (True, or 1.0) at the token ids ``ids[i]`` below ``vocab``, or with
    ``count`` each id's number of occurrences there; zero elsewhere and in the other rows. Built on the device from
    one copy of the (row, id) pairs."""
    out = torch.zeros((b, vocab), dtype=dtype, device=device)
    rows = [np.full(len(t), i, dtype=np.int64) for i, t in ids.items()]
    if not rows:
        return out
    pairs = np.stack([np.concatenate(rows), np.concatenate([np.asarray(t, dtype=np.int64) for t in ids.values()])])
    _put(out, _on_device(np.ascontiguousarray(_in_vocab(pairs, vocab)), device), count)
    return out


def _in_vocab(pairs: np.ndarray, vocab: int) -> np.ndarray:
    """The (row, id) columns of ``pairs`` (2, N) whose id is below ``vocab`` (one outside it has no column)."""
    return pairs[:, (pairs[1] >= 0) & (pairs[1] < vocab)]


def _put(dense: Tensor, pairs: Tensor, count: bool = False) -> None:
    """Set ``dense`` (rows, V) to 1 (True) at the (row, id) columns of ``pairs`` (2, N) on its device, or with
    ``count`` add 1 for each occurrence."""
    if count:
        dense.index_put_((pairs[0], pairs[1]), torch.ones(pairs.shape[1], dtype=dense.dtype, device=dense.device),
                         accumulate=True)
    else:
        dense[pairs[0], pairs[1]] = 1


def _bias_rows(params: Sequence, rows: Sequence[int], b: int, vocab: int, device) -> Tensor:
    """(b, vocab) float32 on ``device``: row ``rows[k]`` holds ``params[k]``'s logit biases, -inf outside its allowed
    token ids (0 elsewhere, and in the other rows)."""
    allowed = {i: p.allowed_token_ids for i, p in zip(rows, params) if p.allowed_token_ids is not None}
    out = torch.zeros((b, vocab), dtype=torch.float32, device=device)
    if allowed:
        out[list(allowed)] = -torch.inf
        out.masked_fill_(_dense_rows(b, vocab, allowed, torch.bool, device), 0.0)
    biases = [(i, t, v) for i, p in zip(rows, params) if p.logit_bias for t, v in p.logit_bias if t < vocab]
    if biases:
        where = _on_device(np.array([[i for i, _, _ in biases], [t for _, t, _ in biases]], dtype=np.int64), device)
        values = _on_device(np.array([v for *_, v in biases], dtype=np.float32), device)
        out.index_put_((where[0], where[1]), values, accumulate=True)
    return out


def bad_word_ids(words: Sequence[str], tokenizer) -> tuple[tuple[int, ...], ...]:
    """The token sequences of ``bad_words``: each word tokenised as it is and, when it has no leading space, with
    one (the form a word takes inside text for most vocabularies), no special tokens; each distinct sequence once."""
    seqs: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word, " " + word) if not word.startswith(" ") else (word,):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                seqs[ids] = None
    return tuple(seqs)


def _bad_words(reqs: Sequence, rows: Sequence[int], b: int, vocab: int, device) -> BadWords:
    """The ``BadWords`` of requests ``reqs`` at rows ``rows`` of a batch of ``b`` (the others ban nothing); a word
    whose last token is outside the vocabulary bans nothing. The columns before a word's leading tokens (which match
    anything) and the words of a row (a word of none bans nothing) are padded to a power of two: a graph captured over
    one batch's ``BadWords`` (``sampled_rule``, keyed by their shapes) serves the next batches' of like sizes."""
    w = _pow2(max(len(s) for r in reqs for s in r.bad_word_ids) - 1)
    n = _pow2(max(len(r.bad_word_ids) for r in reqs))
    tail = np.full((b, w), -1, dtype=np.int64)
    words = np.full((b, n, w + 1), WILDCARD, dtype=np.int64)
    words[..., w] = -1
    for i, r in zip(rows, reqs):
        out = r.tokens[len(r.tokens) - min(w, r.num_output):] if w else []  # (its last w output tokens)
        tail[i, w - len(out):] = out
        for k, seq in enumerate(r.bad_word_ids):
            words[i, k, w - len(seq) + 1:] = seq
            if seq[-1] >= vocab:
                words[i, k, w] = -1
    return BadWords(_on_device(tail, device), _on_device(words, device))


def _pow2(n: int) -> int:
    """The least power of two >= ``n`` (0 stays 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _held_back(reqs: Sequence, rows: Sequence[int], b: int, vocab: int, device) -> HeldBack:
    """The ``HeldBack`` of requests ``reqs`` at rows ``rows`` of a batch of ``b`` (the others hold nothing back)."""
    left = np.zeros(b, dtype=np.int64)
    ending = {}
    for i, r in zip(rows, reqs):
        p = r.params
        ending[i] = [*(() if p.ignore_eos else r.eos_token_ids), *p.stop_token_ids]
        left[i] = p.min_tokens - r.num_output
    return HeldBack(_dense_rows(b, vocab, ending, torch.bool, device), _on_device(left, device))


def _output_counts(reqs: Sequence, rows: Sequence[int], b: int, vocab: int, device,
                   counts: Tensor | None = None) -> OutputCounts:
    """The ``OutputCounts`` of rows ``rows`` of ``reqs`` in a batch of ``b`` rows (the others count nothing, or
    whatever ``counts`` (B, V), gathered from a ``ContextState``, holds: their penalties are 0)."""
    presence, frequency = np.zeros(b, dtype=np.float32), np.zeros(b, dtype=np.float32)
    for i in rows:
        presence[i], frequency[i] = reqs[i].params.presence_penalty, reqs[i].params.frequency_penalty
    if counts is None:
        counts = _dense_rows(b, vocab, {i: reqs[i].output_ids for i in rows}, torch.float32, device, count=True)
    return OutputCounts(counts, *(_on_device(a, device) for a in (presence, frequency)))


def penalized_rows(reqs: Sequence, rows: Sequence[int]) -> list[int]:
    """The rows of ``rows`` whose request's logits this step are changed (``Request.penalized``)."""
    return [i for i in rows if reqs[i].penalized]
