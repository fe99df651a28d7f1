"""One target forward over each row's pending token + draft tree, then the lossless rule."""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec.acceptance import shape_probs, verify_greedy, verify_stochastic
from specdec.acceptance_batched import unpack_greedy
from specdec.fault_isolation import check_finite, check_finite_flags
from specdec.runner import ModelRunner, RowInput
from specdec.scheduler.request import Request
from specdec.tree import DraftTree


class VerifyResult(NamedTuple):
    accepted_nodes: list[int]
    accepted_tokens: list[int]
    bonus_token: int
    num_drafted: int
    max_depth: int
    draft_computed: frozenset[int] | None  # nodes whose draft KV exists; None = model-free drafter
    features: torch.Tensor | None = None  # target aux features of the pending token + accepted path (m+1, k*H)


class Verifier:
    """Verifies draft trees with the target model (pool model 0)."""

    def __init__(self, target, runner: ModelRunner, aux_layers: tuple[int, ...] = ()) -> None:
        self.target, self.runner, self.aux_layers = target, runner, tuple(aux_layers)

    def verify(self, rows: list[Request], trees: list[DraftTree], draft_computed) -> list[VerifyResult]:
        """Accept a path of each row's tree; output distribution is exactly the target's."""
        if not rows:
            return []
        inputs = [self._row(r, t) for r, t in zip(rows, trees)]
        fwd = self.runner.forward(0, self.target, inputs, self.aux_layers)
        greedy_rows = None
        if fwd.accept is not None:  # graphed step: (B, Q+3), the step's one device->host read
            greedy_rows = fwd.accept.tolist()
            check_finite_flags(rows, [row[-1] for row in greedy_rows], "target")
        else:
            check_finite(rows, fwd.logits, "target")  # names the rows with NaN/inf logits; the engine fails them
        results = []
        for i, (req, tree, dc) in enumerate(zip(rows, trees, draft_computed)):
            p = req.params
            h = tree.host
            if p.greedy and greedy_rows is not None:
                nodes, bonus = unpack_greedy(greedy_rows[i])
                results.append(VerifyResult(nodes, [h.tokens[j] for j in nodes], bonus, len(h.tokens),
                                            tree.max_depth, dc))
                continue
            lg = fwd.logits[i]
            lg = lg.view(-1, lg.shape[-1])  # (N+1, V)
            if p.greedy:
                acc = verify_greedy(tree, lg.argmax(-1))
            else:
                probs = shape_probs(lg, p.temperature, p.top_k, p.top_p)
                acc = verify_stochastic(tree, probs, req.generator)
            results.append(VerifyResult(list(acc.accepted_nodes), list(acc.accepted_tokens), int(acc.bonus_token),
                                        tree.num_nodes, tree.max_depth, dc))
        if fwd.features is not None:  # the pending token's and the accepted path's, one gather for the batch
            feats = fwd.features.gather([[0] + [1 + a for a in r.accepted_nodes] for r in results])
            results = [r._replace(features=f) for r, f in zip(results, feats)]
        return results

    @staticmethod
    def _row(req: Request, tree: DraftTree) -> RowInput:
        L = len(req.tokens)
        h = tree.host
        n = len(h.tokens)
        positions = [L - 1] + [L + d for d in h.depth]
        masks, parents = tree.verify_rows()
        return RowInput(req, [req.tokens[-1]] + h.tokens, positions, L - 1, L + n, masks if n else None,
                        want_logits="all", parents=parents)


def new_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A per-request generator; unseeded requests draw their seed from torch's global RNG."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return g
