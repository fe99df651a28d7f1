"""One target forward over each row's pending token + draft tree, then the lossless rule."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from specdec.acceptance import shape_probs, verify_greedy
from specdec.acceptance_batched import pad_trees, unpack_greedy
from specdec.fault_isolation import check_distribution, check_finite, check_finite_flags, flag_overflow
from specdec.fused_step import DeviceDraft, FusedOutcome
from specdec.graphs import cache_for
from specdec.kernels.gumbel_choice import choose_tokens
from specdec.logprobs import keep_logits, with_logprobs
from specdec.pipeline import HostRead, QueuedStep
from specdec.repetition_penalty import ContextPenalty, ContextState, penalized_rows
from specdec.row_sampling import sampling_rows
from specdec.runner import ModelRunner, RowInput
from specdec.sampled_rule import SampledRule, accept_sampled, verify_positions
from specdec.scheduler.request import Request
from specdec.step_inputs import PackedRows
from specdec.tree import DraftTree
from specdec.tree_writer import shape_depth
from specdec.uniform_stream import UniformStream


class VerifyResult(NamedTuple):
    accepted_nodes: list[int]
    accepted_tokens: list[int]
    bonus_token: int
    num_drafted: int
    max_depth: int
    draft_computed: frozenset[int] | None  # nodes whose draft KV exists; None = model-free drafter
    kv_moved: bool = False  # the accepted path's KV is already in place (moved on the device: specdec.pipeline)
    ranks: list[int] | None = None  # the accepted nodes' score ranks (a budget of n keeps those below n); None:
    #                                 their indices (a chain's or a static tree's budget keeps its first nodes)
    logprobs: list[dict[int, tuple[float, int]]] | None = None  # SamplingParams.logprobs: per committed token
    #                                 (accepted, then bonus) {token: (log-probability, rank)}, the chosen one first


# A padded step whose logits are per-row tensors (not one (B * Q, V) output) runs the sampled rule eagerly over
# them from this many sampled rows, the host rule (a few launches per row) below it. Every path chooses each
# token with the same keyed noise (``kernels.gumbel_choice``), so a seeded request's tokens do not depend on it.
DEVICE_SAMPLED_MIN_ROWS = 8


class Verifier:
    """Verifies draft trees with the target model (pool model 0)."""

    def __init__(self, target, runner: ModelRunner, aux_layers: tuple[int, ...] = ()) -> None:
        self.target, self.runner, self.aux_layers = target, runner, tuple(aux_layers)
        # device work launched right behind a graphed greedy verify and read with its outcome (``launch(rows, key,
        # fwd)`` -> (R, Q + 3 + ...) device output or None, ``follow``, ``consume(rows, host_rows)``, ``source``):
        # ``drafters.ngram_device.DeviceNgram``, or ``pipeline_hooks.DecodeFollow`` for pipelined target-only decoding
        self.followup = None
        self.fused = None  # a ``fused_step.FusedVerify``: the verify of trees still on the device (``DeviceDraft``)
        self.pipeline = None  # a ``pipeline.StepPipeline``: queues the next step behind each verify launched here
        self.reader = HostRead(runner.device)  # the one read of a step launched here (two in flight at most)
        # the sampled rows of a padded step, graphed on CUDA
        self.sampled_rule = SampledRule(runner.device, use_triton=runner.backend.uses_triton,
                                        graphs=cache_for(runner.graphs, "sampled rule", runner.device, "own"),
                                        context=ContextState(runner.tables.host.shape[0], runner.device))

    def verify(self, rows: list[Request], trees: list[DraftTree], draft_computed) -> list[VerifyResult]:
        """Accept a path of each row's tree; output distribution is exactly the target's."""
        if not rows:
            return []
        fwd, key = self._graphed(rows, trees)
        if fwd is None:  # no graph bucket holds the step: packed rows, eagerly
            fwd = self.runner.forward(0, self.target, [self._row(r, t) for r, t in zip(rows, trees)],
                                      self.aux_layers)
        logits = fwd.logits
        if fwd.accept is not None:  # padded step: every row's outcome on the device
            outcome = self._outcome(rows, trees, fwd, key)
            step = self._read_behind(rows, key, fwd, outcome)
            logits = keep_logits(rows, logits) if step is not None and self.pipeline is not None else logits
            results = self._from_device(rows, trees, draft_computed, fwd, outcome, step, self._queue(rows, step))
        else:
            results = self._on_host(rows, trees, draft_computed, fwd)
        return with_logprobs(rows, logits, results)

    def verify_proposal(self, rows: list[Request], proposal) -> list[VerifyResult]:
        """``verify`` of a proposer's ``Proposal``, then the acceptance rule, with the step's one read. Trees still
        on the device (``fused_step.DeviceDraft``) are verified right behind their draft, with no host read between;
        a step queued on the device (``pipeline.QueuedStep``, adopted) is read. Either way the next step may be
        queued behind it first (``pipeline``)."""
        device = proposal.device
        if device is None:
            return self.verify(rows, proposal.trees, proposal.draft_computed)
        step = device if isinstance(device, QueuedStep) else self.launch_queued(rows, device.key, device.n, device)
        logits = step.fwd.logits  # (copied for log-probabilities before a step is queued behind it)
        logits = keep_logits(rows, logits, step.key[2], step.sel) if self.pipeline is not None else logits
        queued = self._queue(rows, step)
        if step.trees is not None:  # an EAGLE step: its trees and outcome come with the read
            results = self._fused_results(rows, proposal, step, queued)
        else:  # (a queued chain step's sampled rows went through the rule when it was launched: its read holds them)
            results = self._from_device(rows, proposal.trees, proposal.draft_computed, step.fwd, step.fwd.accept,
                                        step, queued)
        return with_logprobs(rows, logits, results)

    def launch_queued(self, rows: list[Request], key, n: int, draft: DeviceDraft | None,
                      ahead: tuple[torch.Tensor, torch.Tensor] | None = None) -> QueuedStep:
        """Launch the verify of bucket ``key`` over ``rows`` whose inputs are on the device, and start its read:
        the trees ``draft`` keeps under budget ``n`` (then its lossless rule for sampled rows too), or (None) a
        verify whose inputs a queued step's writer filled whole (then the lossless rule for sampled rows, over the
        chains the writer put in the inputs, and the follow-up launch behind it). ``ahead``: a queued step's, the
        tokens the step before it commits (``repetition_penalty.committed_ahead``), which the processed logits of
        rows that read their context (``Request.reads_context``) count."""
        r = len(rows)
        if draft is not None:
            fwd, tokens, parents, top, ranks = self.fused.launch_draft(draft)
            accept = self.fused.outcome(key, rows, fwd, tokens.shape[1], ahead)  # (B, Q + 3): sampled rows: the rule
            reads = [tokens] + ([] if isinstance(parents, tuple) else [parents, top, ranks]) + [accept[:r]]
            return QueuedStep(rows, key, n, fwd, accept, self.reader.start(reads), (tokens, parents, top, ranks),
                              draft)
        graphs = self.runner.graphs
        fwd, views = graphs.replay(key), graphs.inputs.views(key[1], key[2])
        sampled = [i for i, req in enumerate(rows) if not req.plain_greedy]  # (and processed greedy rows)
        if sampled:  # each chain at most q - 1 nodes, cut on the device: the rule reads its length from the inputs
            _write(fwd.accept, self.sampled_rule.on_views(rows, sampled, key[2], views, fwd.logits, fwd.accept,
                                                          graphs.captured(key), ragged=True, ahead=ahead))
        out = self.followup.follow(rows, key, fwd.accept)
        return QueuedStep(rows, key, n, fwd, out, self.reader.start([out]))

    def _outcome(self, rows: list[Request], trees: list[DraftTree], fwd, key) -> torch.Tensor | None:
        """(B, Q + 3) outcome of a padded step of graph bucket ``key``: the verify's greedy acceptance, its sampled
        rows (and penalized greedy ones, ``Request.penalized``: their argmax is the changed logits') through the device
        rule (``_sampled_outcome``); None when those take the host rule."""
        sampled = [i for i, r in enumerate(rows) if not r.plain_greedy]
        return self._sampled_outcome(rows, trees, sampled, fwd, key) if sampled else fwd.accept

    def _read_behind(self, rows: list[Request], key, fwd, outcome: torch.Tensor | None) -> QueuedStep | None:
        """The step of a graphed verify ``fwd`` (bucket ``key``, its step's ``outcome``) when a follow-up runs behind
        it and is read with its outcome, else None (the outcome alone is read). The follow-up runs behind plain
        greedy rows, and when pipelined behind sampled and processed rows too; their outcome is the rule's, written
        into the verify's outcome buffer, which the follow-up and a queued step's writer read."""
        if self.followup is None or key is None or outcome is None:
            return None
        if not all(r.plain_greedy for r in rows):
            if self.pipeline is None:
                return None
            _write(fwd.accept, outcome)
        out = self.followup.launch(rows, key, fwd)
        return None if out is None else QueuedStep(rows, key, None, fwd, out, self.reader.start([out]))

    def _queue(self, rows: list[Request], step: QueuedStep | None) -> QueuedStep | None:
        """The step queued behind ``step`` (launched, its read started), if the pipeline queued one."""
        return None if step is None or self.pipeline is None else self.pipeline.queue(rows, step)

    def _fused_results(self, rows: list[Request], proposal, step: QueuedStep, queued: QueuedStep | None):
        """Results of an EAGLE step whose trees were on the device, from its read (per row: the kept trees' tokens,
        their parents and max depth unless they share a static shape, then the outcome). ``queued``: the step
        queued behind it, which is told the rows' lengths; its catch-up inputs then hold this step's features,
        and this step's accepted KV already moved on the device."""
        host = step.read()  # (R, C): the step's one device->host read
        tokens, parents = step.trees[:2]
        r, k = host.shape[0], tokens.shape[1]
        shared = isinstance(parents, tuple)
        if shared:
            host_parents, depth, ranks = parents, np.full(r, shape_depth(parents), dtype=np.int64), None
        else:  # the depths and score ranks came with the read (computed where the trees were written)
            host_parents, depth, ranks = host[:, k:2 * k], host[:, 2 * k], host[:, 2 * k + 1:3 * k + 1]
        accept = host[:, k if shared else 3 * k + 1:]  # (R, Q + 3)
        if queued is not None:
            queued.assume(rows, accept[:, 0])
        proposal.trees.fill(host[:, :k], host_parents)
        # an EAGLE step queued behind this one moved the accepted paths' KV (and features) on the device
        moved = queued is not None and queued.draft is not None
        return _from_fused(rows, proposal.draft_computed, FusedOutcome(accept, host[:, :k], depth, moved, ranks))

    def _graphed(self, rows: list[Request], trees: list[DraftTree]):
        """The target forward of a graphed step built straight from the trees, and its graph bucket; (None, None)
        when no graph holds it."""
        lengths = [len(t.host.tokens) + 1 for t in trees]
        longest = max(lengths)
        if self.pipeline is not None:  # a step whose successor is queued runs in the bucket the successor needs
            longest = max(longest, self.pipeline.min_query(rows))
        key = self.runner.packed_key(0, len(rows), longest, self.aux_layers)
        if key is None:
            return None, None
        runner = self.runner
        runner.sync_tables(rows)
        bt = runner.tables.host_rows([r.bt_row for r in rows])
        packed = _packed(rows, trees, lengths, key[2], bt, runner.pool.block_size)
        return runner.forward_packed(key, rows, packed, lengths, bt_rows=bt), key

    @staticmethod
    def _on_host(rows: list[Request], trees: list[DraftTree], draft_computed, fwd) -> list[VerifyResult]:
        """Results of an eager step: each row's logits through the host rules."""
        check_finite(rows, fwd.logits, "target")  # names the rows with NaN/inf logits; the engine fails them
        results = []
        for i, (req, tree, dc) in enumerate(zip(rows, trees, draft_computed)):
            acc = _host_rule(req, tree, fwd.logits[i])
            results.append(VerifyResult(list(acc.accepted_nodes), list(acc.accepted_tokens), int(acc.bonus_token),
                                        tree.num_nodes, tree.max_depth, dc))
        return results

    def _from_device(self, rows: list[Request], trees: list[DraftTree], draft_computed, fwd,
                     outcome: torch.Tensor | None, step: QueuedStep | None = None,
                     queued: QueuedStep | None = None) -> list[VerifyResult]:
        """Results of a padded step from its ``outcome`` (``_outcome``; one device->host read of the (B, Q + 3)
        outcome), its sampled rows put through the host rule on their logits when it is None. ``step``: the step
        when a follow-up ran behind its verify; its read (the outcome rows, then the follow-up's columns) is read
        instead and handed to ``followup.consume``; ``queued``: the step queued behind it, told the rows' lengths.
        Penalized greedy rows count as sampled here: their argmax is the changed logits'."""
        sampled = [i for i, r in enumerate(rows) if not r.plain_greedy]
        on_host = set(sampled) if outcome is None else set()
        accept = fwd.accept if outcome is None else outcome
        if step is None:
            host = accept.tolist()  # (B, Q + 3): [m, bonus, path..., finite], the step's one device->host read
        else:
            full, width = step.read().tolist(), accept.shape[1]  # the same read, the follow-up's columns after each
            self.followup.consume(rows, full)
            if queued is not None:
                queued.assume(rows, np.fromiter((row[0] for row in full), np.int64, len(full)))
            host = [row[:width] for row in full]
        check_finite_flags(rows, [row[-1] for row in host], "target")
        results = []
        for i, (req, row, tree, dc) in enumerate(zip(rows, host, trees, draft_computed)):
            if i in on_host:
                acc = _host_rule(req, tree, fwd.logits[i])
                nodes, bonus = list(acc.accepted_nodes), int(acc.bonus_token)
            else:
                nodes, bonus = unpack_greedy(row)
            h = tree.host
            results.append(VerifyResult(nodes, [h.tokens[j] for j in nodes], bonus, len(h.tokens), tree.max_depth, dc))
        return results

    def _sampled_outcome(self, rows: list[Request], trees: list[DraftTree], sampled: list[int], fwd, key):
        """(B, Q + 3) outcome of a padded step with the ``sampled`` rows through the device rule, or None when
        they take the host rule: ``SampledRule`` when the step's logits are one (B * Q, V) tensor (replayed when
        the verify is a captured graph), whatever the row count; otherwise the same rule eagerly over the rows'
        logits from ``DEVICE_SAMPLED_MIN_ROWS`` sampled rows on."""
        full = getattr(fwd.logits, "logits", None)  # the step's (B * Q, V) output, unless a caller re-wrapped it
        graphs = self.runner.graphs
        captured = key is not None and graphs is not None and graphs.captured(key)
        if isinstance(full, torch.Tensor):
            return self.sampled_rule(rows, trees, sampled, full, fwd.accept, captured)
        if len(sampled) < DEVICE_SAMPLED_MIN_ROWS:
            return None
        accept = fwd.accept.clone()
        accept[sampled, :-1] = _accept_sampled([rows[i] for i in sampled], [trees[i] for i in sampled],
                                               fwd.logits, sampled, accept.shape[1] - 3)
        # (SampledRule clears the flag itself) a sampled distribution that overflows fails its row
        return flag_overflow(accept, fwd.logits, rows, sampled, [len(t.host.tokens) + 1 for t in trees])

    @staticmethod
    def _row(req: Request, tree: DraftTree) -> RowInput:
        L = len(req.tokens)
        h = tree.host
        n = len(h.tokens)
        masks, parents = tree.verify_rows()
        return RowInput(req, [req.tokens[-1]] + h.tokens, _positions(req, tree), L - 1, L + n, masks if n else None,
                        want_logits="all", parents=parents)


@torch.inference_mode()
def _write(accept: torch.Tensor, outcome: torch.Tensor) -> None:
    """A step's ``outcome`` (B, Q + 3) into its verify's outcome buffer ``accept`` (an inference tensor)."""
    accept.copy_(outcome)


def _from_fused(rows: list[Request], draft_computed, fused) -> list[VerifyResult]:
    """Results of a fused step (``specdec.fused_step.FusedOutcome``: the trees' tokens and depths and the
    acceptance, sampled rows' included, already on the host), as ``Verifier._from_device`` gives for the same
    trees."""
    accept, tokens = fused.accept, fused.tokens  # (R, Q + 3), (R, n)
    if not accept[:, -1].all():  # some row's logits are not finite: name them
        check_finite_flags(rows, accept[:, -1].tolist(), "target")
    counts = accept[:, 0]  # (R,) accepted nodes
    width = int(counts.max(initial=0))
    nodes = accept[:, 2:2 + width] - 1  # (R, width): the accepted path's node indices (valid below counts)
    picked = np.take_along_axis(tokens, nodes.clip(min=0), 1) if width else nodes  # (R, width)
    n = tokens.shape[1]
    moved = fused.kv_moved
    if fused.ranks is None:
        ranks = [None] * len(rows)
    else:  # (the accepted nodes' score ranks, each row's first counts[i])
        ranks = [p[:m] for p, m in zip(np.take_along_axis(fused.ranks, nodes.clip(min=0), 1).tolist(),
                                       counts.tolist())] if width else [[] for _ in rows]
    return [VerifyResult(path[:m], toks[:m], bonus, n, depth, dc, moved, rk) for path, toks, m, bonus, depth, dc, rk in
            zip(nodes.tolist(), picked.tolist(), counts.tolist(), accept[:, 1].tolist(), fused.max_depth.tolist(),
                draft_computed, ranks)]


def _packed(rows: list[Request], trees: list[DraftTree], lengths: list[int], q: int, bt: np.ndarray,
            block_size: int) -> PackedRows:
    """The verify rows (pending token + tree) of ``rows`` flattened for a padded step of ``q`` queries per
    row; the rows' host block tables ``bt`` (R, W) of ``block_size``-token blocks give their KV slots."""
    ids, depth, masks, parents = [], [], [], []
    for req, tree in zip(rows, trees):
        h = tree.host
        m, p = tree.verify_rows()
        ids.append(req.tokens[-1])
        ids += h.tokens
        depth.append(-1)
        depth += h.depth
        masks += m
        parents += p
    seq = np.fromiter((len(r.tokens) for r in rows), np.int64, len(rows))  # (R,) the pending token is at seq - 1
    n = np.asarray(lengths, dtype=np.int64)  # (R,)
    row = np.repeat(np.arange(len(rows)), n)  # (T,) each query's row
    col = np.arange(row.size) - np.repeat(np.cumsum(n) - n, n)  # (T,) its rank in the row
    kv = seq[row] - 1 + col  # (T,) logical KV positions: L - 1, L, ...
    slots = bt[row, kv // block_size].astype(np.int64) * block_size + kv % block_size
    tokens = np.array([ids, depth, slots, masks, parents], dtype=np.int64)  # (5, T)
    tokens[1] += seq[row]  # RoPE positions: the root at seq - 1, depth d at seq + d
    return PackedRows(row * q + col, tokens, np.stack([seq - 1, seq - 1 + n, n]))


def _accept_sampled(rows: list[Request], trees: list[DraftTree], logits, index: list[int], q: int) -> torch.Tensor:
    """(S, Q + 2) device acceptance of the sampled rows ``index`` of a padded step with Q = q whose logits are
    per-row tensors (``sampled_rule.accept_sampled``)."""
    picked = torch.stack([F.pad(logits[i], (0, 0, 0, q - logits[i].shape[0])) for i in index]).float()  # (S, Q, V)
    dev = picked.device
    padded = pad_trees(trees, q, dev)
    penalized = penalized_rows(rows, range(len(rows)))
    if penalized:
        penalty = ContextPenalty.of(rows, penalized, len(rows), picked.shape[-1], dev)
        picked = penalty.apply(picked, padded.tokens, padded.tree_mask)  # (S, Q, V)
    keys = torch.tensor([[r.stream.key0, r.stream.key1, len(r.tokens) - 1] for r in rows], dtype=torch.int64).to(dev)
    positions = verify_positions(keys[:, 2], padded.tree_mask)
    return accept_sampled(picked, padded.tokens, padded.parents, padded.tree_mask, padded.num_tokens,
                          sampling_rows([r.params for r in rows], dev), keys[:, 0], keys[:, 1], positions)


def _positions(req: Request, tree: DraftTree) -> list[int]:
    """The sequence positions of a row's verify tokens: the pending token's (L - 1), then each node's (L + depth)."""
    L = len(req.tokens)
    return [L - 1] + [L + d for d in tree.host.depth]


def _host_rule(req: Request, tree: DraftTree, logits: torch.Tensor):
    """The host acceptance rule of one row over its verify logits ((N+1) x V), after its penalties: the
    tree's path matching the target's choice after each verify token (its argmax, or for a sampled row the
    Gumbel-max sample keyed by the request and the position, ``kernels.gumbel_choice``)."""
    p = req.params
    lg = logits.view(-1, logits.shape[-1])  # (N+1, V)
    if req.penalized:
        masks = torch.tensor([tree.verify_rows()[0]], dtype=torch.int64, device=lg.device)  # (1, N+1)
        tokens = torch.tensor([[0, *tree.host.tokens]], dtype=torch.int64, device=lg.device)  # (1, N+1)
        lg = ContextPenalty.of([req], [0], 1, lg.shape[-1], lg.device).apply(lg.unsqueeze(0), tokens, masks)[0]
    if p.greedy:
        return verify_greedy(tree, lg.argmax(-1))
    probs = shape_probs(lg, p.temperature, p.top_k, p.top_p, p.min_p)  # (N+1, V)
    check_distribution(req, probs, "target")
    n, dev = lg.shape[0], lg.device
    positions = torch.tensor(_positions(req, tree), dtype=torch.int64, device=dev)  # (N+1,)
    s = req.stream
    key = torch.tensor([s.key0, s.key1], dtype=torch.int64, device=dev)
    kept = probs > 0 if p.filtered else None
    choices = choose_tokens(lg, torch.full((n,), p.temperature, dtype=torch.float64, device=dev),
                            key[0].expand(n), key[1].expand(n), positions + 1, kept)
    return verify_greedy(tree, choices)


def request_stream(seed: int | None) -> UniformStream:
    """A sampled request's noise key, from its seed (unseeded requests draw one from torch's global RNG)."""
    return UniformStream(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
