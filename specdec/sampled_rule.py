"""The sampled rows of a padded verify step through the lossless rule as one CUDA graph replay per bucket.

Eagerly, the rule with its inputs (``pad_trees``, ``sampling_rows``, ``draw_uniforms``) is dozens of small
launches for the host to issue. Here the host writes one int64 array per step (each row's padded tree,
sampling parameters, uniform-stream key and counter, whether it samples), the device gets it in one copy,
and a graph captured per bucket runs the whole rule: the uniforms (``padded_uniforms``), the shaped target
distributions, one draw per verify token, the walk down the trees, and the merge with the verify graph's
greedy outcome, so the step still ends with one device->host read of a (B, Q + 3) outcome.

The captured rule serves trees whose children are deterministic (n-gram chains, trees an EAGLE draft grew
by rank, empty trees: no draft distributions), so it is the single-draw form ``accept_deterministic_padded``,
a fixed handful of ops over (B, Q, V) whatever the trees' shapes. No row is greedy inside the captured rule
(greedy rows keep the verify graph's outcome); one host flag is part of the key: ``filtered`` (some row uses
top-k, top-p or min-p: the sort). Rows with a repetition penalty (greedy ones too: their argmax is the
penalized logits') run the same rule eagerly, with their context's tokens as one more input
(``repetition_penalty.ContextPenalty``). Trees with draft distributions take ``accept_stochastic_padded``
eagerly (``applies``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from specdec.acceptance_stochastic import (
    MODE_CODE,
    PaddedTrees,
    RowSampling,
    accept_deterministic_padded,
    accept_deterministic_walk,
    tree_rows,
)
from specdec.pipeline import HostUpload
from specdec.repetition_penalty import ContextPenalty, penalized_rows
from specdec.tree import DraftTree
from specdec.uniform_stream import padded_uniforms

_DET = MODE_CODE["deterministic"]
_ONE_BITS = int(np.float64(1.0).view(np.int64))  # float64 1.0 as int64 bits: temperature and top_p of idle rows
# columns after the 3 Q tree columns of a row of the step's int64 array (the last three: float64 bits)
_N, _KEY0, _KEY1, _COUNTER, _TOP_K, _SAMPLED, _TEMPERATURE, _TOP_P, _MIN_P = range(9)
_COLUMNS = 9
# draw along the walk (levels + 1 rounds over (B, V)) when that leaves at least this many of the B * Q target
# distributions unshaped: each round costs a fixed set of launches (the sort's among them), so at a batch of one
# the single pass over (B, Q, V) is cheaper (bench_steps.py::test_sampled_rule)
WALK_MIN_SAVED = 96


def applies(trees: Sequence[DraftTree]) -> bool:
    """The trees (of the sampled rows) can go through the captured rule: none has draft distributions."""
    return all(t.draft_dists is None or t.child_mode == "deterministic" or not t.num_nodes for t in trees)


def step_array(rows: Sequence, trees: Sequence[DraftTree], sampled: Sequence[int], b: int, q: int) -> np.ndarray:
    """(b, 3 q + 9) int64 inputs of the rule for the sampled rows ``sampled`` of ``rows``/``trees`` (other rows
    idle: no tree, not sampled): each row's padded tree, then its ``sampling_array`` columns; each sampled row's
    stream advances by the n + 1 draws its tree uses."""
    tree_cols = np.zeros((b, 3 * q), dtype=np.int64)
    for i in sampled:
        if trees[i].num_nodes + 1 > q:
            raise ValueError(f"trees[{i}] has {trees[i].num_nodes} nodes; at most q - 1 = {q - 1} fit")
        tree_cols[i] = tree_rows(trees[i], q)
    draws = {i: trees[i].num_nodes + 1 for i in sampled}
    return np.concatenate([tree_cols, sampling_array(rows, draws, b)], 1)


def rule(inputs: Tensor, logits: Tensor, accept: Tensor, filtered: bool, penalty: ContextPenalty | None = None,
         any_greedy: bool = False, levels: int | None = None) -> Tensor:
    """(B, Q + 3) outcome of a padded step: the sampled rows' from the lossless rule over ``logits`` (B * Q, V),
    the others' ``accept`` (B, Q + 3, the verify's greedy outcome; its last column, the finite flag, is kept
    for every row). ``inputs``: ``step_array``'s (B, 3 Q + 9) on the device. ``penalty``: the rows' repetition
    penalty, applied to the logits first; ``any_greedy``: some sampled row has temperature 0 (a penalized greedy
    row: its outcome is the penalized argmax's); ``levels``: a bound on the trees' levels below the root, which
    lets the rule draw only along the walk (``accept_deterministic_walk``; not with a penalty). No host reads."""
    b, q = accept.shape[0], accept.shape[1] - 3

    def col(j: int) -> Tensor:  # (B,) column j after the tree columns
        return inputs[:, 3 * q + j]

    trees = PaddedTrees(inputs[:, :q], inputs[:, q:2 * q], inputs[:, 2 * q:3 * q], torch.full_like(inputs[:, :q], -1),
                        col(_N), torch.full_like(col(_N), _DET), None, q - 1, frozenset({"deterministic"}))
    sampling = RowSampling(col(_TEMPERATURE).view(torch.float64), col(_TOP_K), col(_TOP_P).view(torch.float64),
                           filtered, any_greedy, col(_MIN_P).view(torch.float64))
    uniforms = padded_uniforms(col(_KEY0), col(_KEY1), col(_COUNTER), col(_N), q)  # (B, Q)
    x = logits.view(b, q, -1)  # (B, Q, V)
    if levels is not None and penalty is None:
        out = accept_deterministic_walk(x, trees, sampling, uniforms, levels)  # (B, Q + 2)
    else:
        x = x.float()
        if penalty is not None:
            x = penalty.apply(x, trees.tokens, trees.tree_mask)
        out = accept_deterministic_padded(x, trees, sampling, uniforms)
    # a sampled row whose logits over its temperature overflow has no finite distribution: its row fails
    real = torch.arange(q, device=x.device) < col(_N).view(-1, 1)  # (B, Q)
    peak = torch.where(real, x.abs().amax(-1).float(), 0.0).amax(-1)  # (B,) (the max of |x| is exact in x's dtype)
    t = sampling.temperature.float()
    t = torch.where(t > 0, t, 1.0) if any_greedy else t  # a greedy row's argmax needs finite logits only
    finite = accept[:, -1:] * torch.isfinite(peak / t).view(-1, 1).to(accept.dtype)
    return torch.where((col(_SAMPLED) > 0).view(-1, 1), torch.cat([out, finite], 1), accept)


def walk_levels(levels: int | None, b: int, q: int, min_saved: float = WALK_MIN_SAVED) -> int | None:
    """``levels`` (a bound on the trees' levels below the root) when the rule should draw along the walk in a
    bucket of ``b`` rows of ``q`` verify tokens (leaving at least ``min_saved`` distributions unshaped), else
    None (one draw at every verify token)."""
    return levels if levels is not None and b * (q - levels - 1) >= min_saved else None


def sampling_array(rows: Sequence, draws: dict[int, int], b: int) -> np.ndarray:
    """(b, 9) int64 sampling columns of the rule: for each sampled row i (a key of ``draws``) the ``draws[i]``
    uniforms it uses, its stream's key and counter, top-k, the sampled flag, and temperature, top-p and min-p as
    their float64 bits; the stream advances by ``draws[i]`` (a greedy row, penalized, has none: key and counter
    0, its draws unused). Other rows are idle (temperature and top-p 1, min-p 0)."""
    host = np.zeros((b, _COLUMNS), dtype=np.int64)
    host[:, _TEMPERATURE:_MIN_P] = _ONE_BITS
    for i, n in draws.items():
        p, s = rows[i].params, rows[i].stream
        key = (0, 0, 0) if s is None else (s.key0, s.key1, s.counter)
        host[i, :_TEMPERATURE] = n, *key, p.top_k or 0, 1
        host[i, _TEMPERATURE:] = np.array([p.temperature, p.top_p, p.min_p], dtype=np.float64).view(np.int64)
        if s is not None:
            s.counter += n
    return host


def rule_on_views(inputs: Tensor, views, logits: Tensor, accept: Tensor, filtered: bool, ragged: bool = False,
                  **options) -> Tensor:
    """``rule`` of a step whose trees are read from its verify inputs ``views`` (``StepViews`` of the bucket:
    tokens, parents, tree masks) and whose sampling columns are ``inputs`` (B, 9) (``sampling_array``).
    ``ragged``: a row's verify tokens are its ``views.num_tokens`` when fewer than its count in ``inputs`` (chains
    cut on the device), which then sets its uniforms' columns (the bonus token's is the last draw it uses)."""
    b, q = accept.shape[0], accept.shape[1] - 3
    if ragged:
        n = torch.minimum(inputs[:, _N], views.num_tokens.view(-1)[:b])  # (B,)
        inputs = torch.cat([inputs[:, :_N], n.view(-1, 1), inputs[:, _N + 1:]], 1)
    trees = torch.cat([views.ids.view(b, q), views.parents.view(b, q), views.tree_mask.view(b, q), inputs], 1)
    return rule(trees, logits, accept, filtered, **options)


class SampledRule:
    """``rule`` as one CUDA graph replay per (B, Q, filtered, walk levels, verify output buffers) on CUDA, captured
    at its first use into one memory pool shared by these graphs (replayed one at a time, each output read before
    the next replay); eagerly elsewhere, when the verify's outputs are not a captured graph's buffers, or when a
    row has a repetition penalty."""

    def __init__(self, device: torch.device | str, capture: bool | None = None) -> None:
        self.device = torch.device(device)
        self.capture = self.device.type == "cuda" if capture is None else capture  # (False: always eagerly)
        self.upload = HostUpload(self.device)
        self.graphs: dict[tuple, tuple] = {}
        self._pool = None
        self.walk_min_saved = WALK_MIN_SAVED  # (inf: never walk, the bench's comparison)

    def __call__(self, rows: Sequence, trees: Sequence[DraftTree], sampled: Sequence[int], logits: Tensor,
                 accept: Tensor, captured: bool, levels: int | None = None) -> Tensor:
        """(B, Q + 3) outcome of the step whose verify wrote ``logits`` (B * Q, V) and ``accept`` (B, Q + 3), its
        sampled rows ``sampled`` through the rule; ``captured``: those are a captured verify graph's outputs;
        ``levels``: a bound on the sampled trees' levels below the root (None: draw at every verify token)."""
        b, q = accept.shape[0], accept.shape[1] - 3
        return self._run("trees", step_array(rows, trees, sampled, b, q), rule, rows, sampled, logits, accept,
                         captured, levels)

    def on_views(self, rows: Sequence, sampled: Sequence[int], n: int, views, logits: Tensor, accept: Tensor,
                 captured: bool, levels: int | None = None, ragged: bool = False) -> Tensor:
        """``__call__`` for a step whose verify inputs ``views`` hold every row's tree of ``n - 1`` nodes (a fused
        step: the trees never reached the host) with at most ``levels`` levels below the root (None: unknown).
        ``ragged``: at most ``n - 1`` nodes, each row's count in ``views`` (a queued chain step: the chains were cut
        on the device); each sampled row's stream still advances by ``n``, and the step's adopter gives back what
        its chain did not use (``QueuedStep.settle_draws``)."""
        host = sampling_array(rows, dict.fromkeys(sampled, n), accept.shape[0])
        return self._run("chains" if ragged else "views", host,
                         functools.partial(rule_on_views, views=views, ragged=ragged), rows, sampled, logits,
                         accept, captured, levels)

    def _run(self, kind: str, host: np.ndarray, fn, rows: Sequence, sampled: Sequence[int], logits: Tensor,
             accept: Tensor, captured: bool, levels: int | None = None) -> Tensor:
        """``fn(inputs, logits=, accept=, filtered=, levels=)`` over the uploaded ``host``: replayed from the graph
        of (``kind``, B, Q, filtered, walk levels, output buffers) when capturing and ``captured``, else eagerly
        (with the repetition penalty of the rows that have one)."""
        filtered = any(rows[i].params.filtered for i in sampled)
        levels = walk_levels(levels, accept.shape[0], accept.shape[1] - 3, self.walk_min_saved)
        build = functools.partial(fn, logits=logits, accept=accept, filtered=filtered, levels=levels)
        penalized = penalized_rows(rows, sampled)
        if penalized:
            penalty = ContextPenalty.of(rows, penalized, accept.shape[0], logits.shape[-1], self.device)
            return build(self.upload(host), penalty=penalty, any_greedy=any(rows[i].params.greedy for i in sampled))
        if not (self.capture and captured):
            return build(self.upload(host))
        b, q = accept.shape[0], accept.shape[1] - 3
        return self._replay((kind, b, q, filtered, levels, logits.data_ptr(), accept.data_ptr()), host, build)

    def _replay(self, key, host: np.ndarray, build) -> Tensor:
        """Replay the graph of ``key`` (``build(inputs)`` captured over an input buffer shaped like ``host`` on
        first use) after copying ``host`` into its inputs."""
        entry = self.graphs.get(key)
        if entry is None:
            from specdec.graphs import capture_graph

            if self._pool is None and self.device.type == "cuda":
                self._pool = torch.cuda.graph_pool_handle()
            inputs = torch.zeros(host.shape, dtype=torch.int64, device=self.device)
            inputs.copy_(self.upload(host))  # the capture's first (uncaptured) run reads a real step's inputs
            graph, out = capture_graph(functools.partial(build, inputs), self._pool, self.device)
            entry = self.graphs[key] = (graph, inputs, out)
        graph, inputs, out = entry
        inputs.copy_(self.upload(host))
        graph.replay()
        return out
