"""The sampled rows of a padded verify step through the lossless rule as one CUDA graph replay per bucket.

The rule: the target's token after every verify token is ``kernels.gumbel_choice.choose_tokens`` of its logits
(for a sampled row the Gumbel-max sample of its shaped distribution, the noise keyed by the request and the
sampled token's sequence position; for a greedy row the argmax), and a row accepts the longest path whose every
token equals the choice at its parent, exactly as greedy rows accept (``accept_greedy_padded``); the bonus token
is the choice at the path's end. This is lossless whatever the draft proposed (each committed token is the
target's own sample at its position), accepts a deterministic child with the rejection rule's probability, and
makes a request's tokens a function of its seed and the target alone: the same whatever tree, budget, batch or
pipelining verified them.

The host writes one int64 array per step (each row's padded tree, its noise key, its root's position, sampling
parameters, whether it samples), the device gets it in one copy, and a graph captured per bucket runs the whole
rule and the merge with the verify graph's greedy outcome, so the step still ends with one device->host read of
a (B, Q + 3) outcome. Fused and queued steps read their trees and positions from the verify's inputs on the
device (``rule_on_views``). One host flag is part of the key: ``filtered`` (some row uses top-k, top-p or
min-p: the kept set is computed). Rows with processed logits (greedy ones too: their argmax is the processed
logits') take the same rule with their processors' inputs (``repetition_penalty.ContextPenalty``: built eagerly
from their tokens, then copied into the graph's own copies of them) as one more input, their layout part of the key.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from specdec.acceptance_batched import accept_greedy_padded, tree_rows
from specdec.graphs import GraphCache
from specdec.kernels.gumbel_choice import choose_filtered_triton, choose_tokens
from specdec.kernels.nucleus import takes_logits as nucleus_takes
from specdec.pipeline import HostUpload
from specdec.repetition_penalty import ContextPenalty, ContextState, path_depth, penalized_rows
from specdec.row_sampling import RowSampling, shape_probs_rows
from specdec.tree import DraftTree

_ONE_BITS = int(np.float64(1.0).view(np.int64))  # float64 1.0 as int64 bits: temperature and top_p of idle rows
# columns after the 3 Q tree columns of a row of the step's int64 array (the last three: float64 bits)
_N, _KEY0, _KEY1, _ROOT, _TOP_K, _SAMPLED, _TEMPERATURE, _TOP_P, _MIN_P = range(9)
_COLUMNS = 9


def step_array(rows: Sequence, trees: Sequence[DraftTree], sampled: Sequence[int], b: int, q: int) -> np.ndarray:
    """(b, 3 q + 9) int64 inputs of the rule for the sampled rows ``sampled`` of ``rows``/``trees`` (other rows
    idle: no tree, not sampled): each row's padded tree, then its ``sampling_array`` columns."""
    tree_cols = np.zeros((b, 3 * q), dtype=np.int64)
    for i in sampled:
        if trees[i].num_nodes + 1 > q:
            raise ValueError(f"trees[{i}] has {trees[i].num_nodes} nodes; at most q - 1 = {q - 1} fit")
        tree_cols[i] = tree_rows(trees[i], q)
    draws = {i: trees[i].num_nodes + 1 for i in sampled}
    return np.concatenate([tree_cols, sampling_array(rows, draws, b)], 1)


def verify_positions(root: Tensor, tree_mask: Tensor) -> Tensor:
    """(B, Q) sequence positions of the verify tokens: ``root`` (B,) the root's (the pending token's), a node's
    the root's plus its depth (the bits of ``tree_mask`` (B, Q) int64 set: itself and its ancestors, root
    included, less one)."""
    return root.view(-1, 1) + path_depth(tree_mask).clamp(min=0)  # (padding, mask 0: depth -1, never read)


def accept_sampled(x: Tensor, tokens: Tensor, parents: Tensor, tree_mask: Tensor, num_tokens: Tensor,
                   sampling: RowSampling, key0: Tensor, key1: Tensor, positions: Tensor, use_triton: bool = False,
                   ) -> Tensor:
    """(B, Q + 2) outcome of sampled (and greedy) rows in ``accept_greedy_padded``'s layout: the target's token
    after each verify token is ``kernels.gumbel_choice.choose_tokens`` of its logits ``x`` (B, Q, V) (the argmax
    for greedy rows; for sampled rows the Gumbel-max sample of the shaped distribution with noise keyed by the
    request (``key0``, ``key1`` (B,)) and the sampled token's position, ``positions`` (B, Q) + 1), and the
    accepted path is the longest whose every token equals the choice at its parent, as for greedy rows. The
    kept set of rows with top-k / top-p / min-p is ``shape_probs_rows``' support (only when
    ``sampling.filtered``); with ``use_triton`` the choice is ``kernels.gumbel_choice.choose_filtered_triton``'s,
    which computes a row's kept set only when its unfiltered choice falls outside it, so no probabilities, mask or
    float32 copy of the (B, Q, V) logits are written. No host reads."""
    b, q, v = x.shape
    per_token = [t.view(-1, 1).expand(b, q).reshape(-1) for t in (sampling.temperature, key0, key1)]
    rows, position = x.reshape(b * q, v), (positions + 1).reshape(-1)
    if sampling.filtered and use_triton and nucleus_takes(x):  # the kept sets only where needed: nothing written
        t = sampling.temperature.float()
        choices = choose_filtered_triton(x, per_token[0], per_token[1], per_token[2], position, sampling,
                                         torch.where(t > 0, t, 1.0) if sampling.any_greedy else t)
        return accept_greedy_padded(tokens, parents, tree_mask, choices.view(b, q), num_tokens)
    kept = (shape_probs_rows(x, sampling, use_triton) > 0).view(b * q, v) if sampling.filtered else None
    choices = choose_tokens(rows, per_token[0], per_token[1], per_token[2], position, kept, use_triton=use_triton)
    return accept_greedy_padded(tokens, parents, tree_mask, choices.view(b, q), num_tokens)


def rule(inputs: Tensor, logits: Tensor, accept: Tensor, filtered: bool, penalty: ContextPenalty | None = None,
         any_greedy: bool = False, positions: Tensor | None = None, use_triton: bool = False) -> Tensor:
    """(B, Q + 3) outcome of a padded step: the sampled rows' from ``accept_sampled`` over ``logits`` (B * Q, V),
    the others' ``accept`` (B, Q + 3, the verify's greedy outcome; its last column, the finite flag, is kept
    for every row). ``inputs``: ``step_array``'s (B, 3 Q + 9) on the device. ``penalty``: the rows' repetition
    and count penalties, applied to the logits first; ``any_greedy``: some sampled row has temperature 0 (a
    penalized greedy row: its outcome is the penalized argmax's); ``positions`` (B, Q): the verify tokens'
    sequence positions (None: from each row's root position column and its tree). No host reads."""
    b, q = accept.shape[0], accept.shape[1] - 3

    def col(j: int) -> Tensor:  # (B,) column j after the tree columns
        return inputs[:, 3 * q + j]

    tokens, parents, masks = inputs[:, :q], inputs[:, q:2 * q], inputs[:, 2 * q:3 * q]
    sampling = RowSampling(col(_TEMPERATURE).view(torch.float64), col(_TOP_K), col(_TOP_P).view(torch.float64),
                           filtered, any_greedy, col(_MIN_P).view(torch.float64))
    if positions is None:
        positions = verify_positions(col(_ROOT), masks)
    x = logits.view(b, q, -1)  # (B, Q, V)
    if penalty is not None:
        x = penalty.apply(x, tokens, masks, use_triton)
    out = accept_sampled(x, tokens, parents, masks, col(_N), sampling, col(_KEY0), col(_KEY1), positions, use_triton)
    # a sampled row whose logits over its temperature overflow has no finite distribution: its row fails (the
    # tokens its processors took out, -inf, are not in it)
    real = torch.arange(q, device=x.device) < col(_N).view(-1, 1)  # (B, Q)
    low, high = torch.aminmax(x if penalty is None else x.masked_fill(x == -math.inf, 0), dim=-1)  # (B, Q)
    peak = torch.where(real, torch.maximum(high, -low).float(), 0.0).amax(-1)  # (B,) max |x| (exact in x's dtype)
    t = sampling.temperature.float()
    t = torch.where(t > 0, t, 1.0) if any_greedy else t  # a greedy row's argmax needs finite logits only
    finite = accept[:, -1:] * torch.isfinite(peak / t).view(-1, 1).to(accept.dtype)
    return torch.where((col(_SAMPLED) > 0).view(-1, 1), torch.cat([out, finite], 1), accept)


def sampling_array(rows: Sequence, draws: dict[int, int], b: int) -> np.ndarray:
    """(b, 9) int64 sampling columns of the rule: for each sampled row i (a key of ``draws``) its ``draws[i]``
    verify tokens (root included), its noise key, its root's sequence position, top-k, the sampled flag, and
    temperature, top-p and min-p as their float64 bits (a greedy row, penalized, has key 0). Other rows are idle
    (temperature and top-p 1, min-p 0)."""
    host = np.zeros((b, _COLUMNS), dtype=np.int64)
    host[:, _TEMPERATURE:_MIN_P] = _ONE_BITS
    if draws:  # (one write per group of columns: a row-by-row fill costs several times as much host time)
        reqs = [rows[i] for i in draws]
        idx = np.fromiter(draws, np.int64, len(draws))
        host[idx, :_TEMPERATURE] = [(n, *((0, 0) if r.stream is None else (r.stream.key0, r.stream.key1)),
                                     len(r.tokens) - 1, r.params.top_k or 0, 1) for r, n in zip(reqs, draws.values())]
        host[idx, _TEMPERATURE:] = np.array([(r.params.temperature, r.params.top_p, r.params.min_p) for r in reqs],
                                            dtype=np.float64).view(np.int64)
    return host


def rule_on_views(inputs: Tensor, views, logits: Tensor, accept: Tensor, filtered: bool, ragged: bool = False,
                  **options) -> Tensor:
    """``rule`` of a step whose trees and positions are read from its verify inputs ``views`` (``StepViews`` of the
    bucket: tokens, parents, tree masks, positions; a queued step's rows are longer than the host knows yet) and
    whose sampling columns are ``inputs`` (B, 9) (``sampling_array``). ``ragged``: a row's verify tokens are its
    ``views.num_tokens`` when fewer than its count in ``inputs`` (chains cut on the device)."""
    b, q = accept.shape[0], accept.shape[1] - 3
    if ragged:
        n = torch.minimum(inputs[:, _N], views.num_tokens.view(-1)[:b])  # (B,)
        inputs = torch.cat([inputs[:, :_N], n.view(-1, 1), inputs[:, _N + 1:]], 1)
    trees = torch.cat([views.ids.view(b, q), views.parents.view(b, q), views.tree_mask.view(b, q), inputs], 1)
    return rule(trees, logits, accept, filtered, positions=views.positions[:b * q].view(b, q), **options)


class SampledRule:
    """``rule`` as one CUDA graph replay per (B, Q, filtered, verify output buffers; processors' layout) on CUDA,
    captured at its first use into one memory pool shared by these graphs (replayed one at a time, each output read
    before the next replay); eagerly elsewhere, or when the verify's outputs are not a captured graph's buffers.
    ``use_triton``: the token choice's kernel (the Triton backend); ``graphs``: the cache of those graphs
    (``GraphRunner.cache``, pool "own")."""

    def __init__(self, device: torch.device | str, capture: bool | None = None, use_triton: bool = False,
                 graphs: GraphCache | None = None, context: ContextState | None = None) -> None:
        self.device = torch.device(device)
        self.context = context  # the rows' contexts kept on the device (an engine's; None: built at each step)
        self.capture = self.device.type == "cuda" if capture is None else capture  # (False: always eagerly)
        self.use_triton = use_triton
        self.upload = HostUpload(self.device)
        self.graphs = graphs if graphs is not None else GraphCache("sampled rule", self.device, "own")

    def __call__(self, rows: Sequence, trees: Sequence[DraftTree], sampled: Sequence[int], logits: Tensor,
                 accept: Tensor, captured: bool) -> Tensor:
        """(B, Q + 3) outcome of the step whose verify wrote ``logits`` (B * Q, V) and ``accept`` (B, Q + 3), its
        sampled rows ``sampled`` through the rule; ``captured``: those are a captured verify graph's outputs."""
        b, q = accept.shape[0], accept.shape[1] - 3
        return self._run("trees", step_array(rows, trees, sampled, b, q), rule, rows, sampled, logits, accept,
                         captured)

    def on_views(self, rows: Sequence, sampled: Sequence[int], n: int, views, logits: Tensor, accept: Tensor,
                 captured: bool, ragged: bool = False, ahead: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``__call__`` for a step whose verify inputs ``views`` hold every row's tree of ``n - 1`` nodes and its
        positions (a fused or queued step: the trees never reached the host). ``ragged``: at most ``n - 1`` nodes,
        each row's count in ``views`` (a queued chain step: the chains were cut on the device). ``ahead``: a
        queued step's rows' tokens that the step before commits, not read yet (``repetition_penalty.committed_ahead``:
        its processed rows' context)."""
        host = sampling_array(rows, dict.fromkeys(sampled, n), accept.shape[0])
        return self._run("chains" if ragged else "views", host,
                         functools.partial(rule_on_views, views=views, ragged=ragged), rows, sampled, logits,
                         accept, captured, ahead)

    def _run(self, kind: str, host: np.ndarray, fn, rows: Sequence, sampled: Sequence[int], logits: Tensor,
             accept: Tensor, captured: bool, ahead: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``fn(inputs, logits=, accept=, filtered=)`` over the uploaded ``host``: replayed from the graph of
        (``kind``, B, Q, filtered, output buffers; and the processors' layout and whether a processed row is greedy)
        when capturing and ``captured``, else eagerly; with the processors of the rows that have them, their context
        joined by ``ahead``."""
        filtered = any(rows[i].params.filtered for i in sampled)
        build = functools.partial(fn, logits=logits, accept=accept, filtered=filtered, use_triton=self.use_triton)
        penalized, penalty = penalized_rows(rows, sampled), None
        key = (kind, accept.shape[0], accept.shape[1] - 3, filtered, logits.data_ptr(), accept.data_ptr())
        if penalized:  # (their context is built eagerly; the rule over it is as fixed in shape as the others')
            penalty = ContextPenalty.of(rows, penalized, accept.shape[0], logits.shape[-1], self.device, ahead,
                                        self.context)
            greedy = any(rows[i].params.greedy for i in sampled)
            build = functools.partial(build, any_greedy=greedy)
            key += (penalty.layout, greedy)
        if not (self.capture and captured):
            return build(self.upload(host)) if penalty is None else build(self.upload(host), penalty=penalty)
        return self._replay(key, host, build, penalty)

    def _replay(self, key, host: np.ndarray, build, penalty: ContextPenalty | None = None) -> Tensor:
        """Replay the graph of ``key`` (``build(inputs)`` captured over an input buffer shaped like ``host`` on
        first use, and with ``penalty`` over a copy of its tensors) after copying ``host`` (and ``penalty``) into
        its inputs."""
        entry = self.graphs.get(key)
        if entry is None:
            inputs = torch.zeros(host.shape, dtype=torch.int64, device=self.device)
            inputs.copy_(self.upload(host))  # the capture's first (uncaptured) run reads a real step's inputs
            fixed = None if penalty is None else penalty.cloned()
            run = functools.partial(build, inputs) if fixed is None else functools.partial(build, inputs,
                                                                                           penalty=fixed)
            graph, out = self.graphs.capture(run)
            entry = self.graphs[key] = (graph, inputs, out, fixed)
        graph, inputs, out, fixed = entry
        inputs.copy_(self.upload(host))
        if fixed is not None:
            fixed.copy_from(penalty)
        graph.replay()
        return out
