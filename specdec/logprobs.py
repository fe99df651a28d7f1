"""Log-probabilities under the target's raw distribution: of the committed tokens (``SamplingParams.logprobs``),
read from a verify's logits after its acceptance, and of the prompt tokens (``SamplingParams.prompt_logprobs``),
read from the prefill's logits. Each token's entry is ``{token: (log-probability, rank)}``, the token itself first
(rank 1 = the most probable), then the k most probable tokens; ``StopChecker`` turns them into ``Logprob``s."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch

from specdec.pipeline import HostRead, HostUpload

Entry = dict[int, tuple[float, int]]


SLICE_ROWS = 1024  # rows of logits made float32 and log-softmaxed at once (a long prompt's chunk: bounded memory)
_LOCAL = threading.local()  # per thread (engines stepped on different threads): its uploads and side streams


def _per_thread(make, device: torch.device):
    """This thread's ``make(device)`` (made on first use): a ``HostUpload``, a ``HostRead`` or a side stream."""
    table = getattr(_LOCAL, "made", None)
    if table is None:
        table = _LOCAL.made = {}
    got = table.get((make, device))
    if got is None:
        got = table[make, device] = make(device)
    return got


def _upload(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device`` through pinned buffers (``HostUpload``, whose two buffers take
    turns: one set per thread): a copy from pageable memory may wait for the stream's work so far, which here is a
    verify in flight (or, before the next step is queued, the pipeline's overlap)."""
    return _per_thread(HostUpload, torch.device(device))(np.asarray(values, dtype=np.int64))


def _read(values: torch.Tensor) -> np.ndarray:
    """float64 ``values`` on the host: on CUDA through pinned buffers (``HostRead``, one per thread), a copy ordered on
    the current stream alone; a read into pageable memory (``.cpu()``) is a synchronous copy, which has been seen to
    wait for other streams' work too (here the step queued behind the verify)."""
    if not values.is_cuda:
        return values.numpy()
    return _per_thread(HostRead, values.device).start([values.view(torch.int64)])().view(np.float64)


def ranked(rows: torch.Tensor, chosen: list[int], ks: list[int]) -> list[Entry]:
    """One entry per row of ``rows`` ((M, V) raw logits): token ``chosen[j]``'s log-probability and rank, then the
    ``ks[j]`` most probable tokens'; ``SLICE_ROWS`` rows at a time, one read each."""
    entries = []
    for s in range(0, rows.shape[0], SLICE_ROWS):
        entries += _ranked(rows[s:s + SLICE_ROWS], chosen[s:s + SLICE_ROWS], ks[s:s + SLICE_ROWS])
    return entries


@torch.inference_mode()
def _ranked(rows: torch.Tensor, chosen: list[int], ks: list[int]) -> list[Entry]:
    lp = torch.log_softmax(rows.float(), -1)  # (M, V)
    ids = _upload(chosen, lp.device)
    own = lp.gather(1, ids[:, None])  # (M, 1)
    ranks = (lp > own).sum(1, keepdim=True) + 1  # (M, 1)
    k = max(ks)
    parts = [own.double(), ranks.double()]  # (float64 holds every float32 value, rank and token id exactly)
    if k:
        top_lp, top_ids = lp.topk(k, -1)  # (M, k)
        parts += [top_lp.double(), top_ids.double()]
    host = _read(torch.cat(parts, 1))  # the one read: (M, 2 + 2k)
    own_h, rank_h = host[:, 0].tolist(), host[:, 1].astype(np.int64).tolist()
    top_lp_h, top_ids_h = host[:, 2:2 + k].tolist(), host[:, 2 + k:].astype(np.int64).tolist()
    entries = []
    for j, want in enumerate(ks):
        entry = {chosen[j]: (own_h[j], rank_h[j])}
        for r, (t, v) in enumerate(zip(top_ids_h[j][:want], top_lp_h[j][:want])):
            entry.setdefault(t, (v, r + 1))
        entries.append(entry)
    return entries


class KeptLogits:
    """The verify logits of the rows that ask for log-probabilities, copied out of a captured verify's output
    (``keep_logits``): ``block`` (n, q, V), row i's padded queries at ``block[where[i]]``; ``ready``: on CUDA, an
    event recorded right after the copy (the step queued behind it comes later on the same stream)."""

    def __init__(self, block: torch.Tensor, where: dict[int, int], ready=None) -> None:
        self.block, self.where, self.ready = block, where, ready


@torch.inference_mode()
def keep_logits(rows: list, logits, q: int | None = None, sel=None):
    """A verify's per-row logits as row i of ``rows`` reads them, safe to read after a step is queued behind the
    verify: when some row asks for log-probabilities and they are views of a captured graph's output (which the
    queued step's replay rewrites), those rows' padded blocks are copied out first (one gather on the device,
    queued behind the verify and ahead of the next step); else ``logits`` itself. ``logits``: the step's
    ``runner._PaddedLogits``, per-row tensors of an eager step, or a queued verify's whole (B * q, V) output;
    ``sel``: a step adopted by some of its rows (``QueuedStep.sel``): row i of ``rows`` is its row ``sel[i]``."""
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if isinstance(logits, torch.Tensor):  # a queued verify's output: every row has q queries
        full = logits
    else:
        full, q = getattr(logits, "logits", None), getattr(logits, "q", q)
    if not asking or not isinstance(full, torch.Tensor):  # (eager logits are the forward's own tensors)
        return logits
    src = [int(sel[i]) if sel is not None else i for i in asking]  # (their rows in the step's output)
    index = _upload(src, full.device)
    block = full.view(-1, q, full.shape[-1]).index_select(0, index)  # (n, q, V): a copy
    ready = None
    if block.is_cuda:
        ready = torch.cuda.Event()
        ready.record()
    return KeptLogits(block, {i: j for j, i in enumerate(asking)}, ready)


def _flat(logits):
    """The verify's logits as one 2-D tensor of query rows and ``first(i)``, the row of row i's first query there:
    (that tensor, ``first``), or None for per-row tensors (an eager step's)."""
    if isinstance(logits, KeptLogits):
        block, where = logits.block, logits.where
        return block.view(-1, block.shape[-1]), lambda i: where[i] * block.shape[1]
    full = getattr(logits, "logits", None)
    if isinstance(full, torch.Tensor) and full.dim() == 2:  # ``runner._PaddedLogits``: row i at i * q
        return full, lambda i: i * logits.q
    return None


@contextlib.contextmanager
def _after(ready):
    """Run the enclosed device work on a side stream that waits for event ``ready`` only (the copy of
    ``keep_logits``), not for the step queued behind it on the current stream: reading the result then waits for
    that work, not for the next step (None: on the current stream)."""
    if ready is None:
        yield
        return
    side = _per_thread(torch.cuda.Stream, torch.device("cuda", torch.cuda.current_device()))
    side.wait_event(ready)
    with torch.cuda.stream(side):
        yield


@torch.inference_mode()
def with_logprobs(rows: list, logits, results: list) -> list:
    """``results`` (``VerifyResult``s) with the log-probabilities of the rows that ask for them: each committed
    token's at the verify query it was chosen at (the root for the first, then each accepted node's). ``logits``:
    the verify's per-row logits (queries in verify order), or ``keep_logits``' copy of them when a step was queued
    behind the verify: then the work runs beside that step (``_after``). The asking rows' queries are gathered in
    one index and read in one copy."""
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not asking:
        return results
    queries = {i: [0, *(n + 1 for n in results[i].accepted_nodes)] for i in asking}
    chosen, ks = [], []
    for i in asking:
        chosen += [*results[i].accepted_tokens, results[i].bonus_token]
        ks += [rows[i].params.logprobs] * len(queries[i])
    flat = _flat(logits)
    with _after(getattr(logits, "ready", None)):
        if flat is not None:  # one source: one gather
            src, first = flat
            picked = src.index_select(0, _upload([first(i) + j for i in asking for j in queries[i]], src.device))
        else:  # (an eager step's per-row tensors)
            picked = torch.cat([logits[i].index_select(0, _upload(queries[i], logits[i].device)) for i in asking])
        entries = ranked(picked, chosen, ks)
    out, at = list(results), 0
    for i in asking:
        n = len(results[i].accepted_tokens) + 1
        out[i] = results[i]._replace(logprobs=entries[at:at + n])
        at += n
    return out


def wants_prompt_logprobs(req, start: int) -> bool:
    """Whether a prefill chunk of ``req`` from position ``start`` predicts prompt tokens whose log-probabilities it
    asks for (``SamplingParams.prompt_logprobs``): the logits at position p give token p + 1's."""
    return req.params.prompt_logprobs is not None and start < req.num_prompt - 1


def prompt_logprobs(chunks: list, logits, stopper) -> None:
    """Fill ``req.prompt_logprobs`` of the prefill ``chunks`` that ask for them (``wants_prompt_logprobs``) from
    their forward's per-row ``logits`` ((end - start, V) each): position p's logits give prompt token p + 1's entry
    (entry 0, the first token's, stays None, as vLLM's). A chunk recomputed after a preemption overwrites nothing
    new: the same positions, the same values."""
    picked, chosen, ks, where = [], [], [], []
    for i, c in enumerate(chunks):
        req = c.req
        if not wants_prompt_logprobs(req, c.start):
            continue
        last = min(c.end, req.num_prompt - 1)  # positions start..last-1 predict prompt tokens start+1..last
        picked.append(logits[i][:last - c.start])
        chosen += req.tokens[c.start + 1:last + 1]
        ks += [req.params.prompt_logprobs] * (last - c.start)
        where += [(req, p) for p in range(c.start + 1, last + 1)]
    if not picked:
        return
    for (req, p), entry in zip(where, ranked(torch.cat(picked), chosen, ks)):
        req.prompt_logprobs[p] = stopper.logprob_entry(entry)
