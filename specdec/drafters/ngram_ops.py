"""Torch reference of the device n-gram step (``kernels/ngram_follow.py`` is the one-launch Triton version): a
graphed verify's greedy outcome extends each row's token history in a device buffer, and the row's next chain
is looked up there with the semantics of ``specdec.drafters.ngram.ngram_lookup``.

Kept apart from ``specdec.drafters.ngram_device`` (which drives it) so ``kernels/ngram_follow.py``, whose op
dispatches to it, imports it without importing the drafters' machinery.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.drafters.ngram import ngram_lookup
from specdec.lookahead_ops import causal_masks


@torch.inference_mode()
def ngram_follow_reference(hist: Tensor, rows: Tensor, ids: Tensor, positions: Tensor, accept: Tensor, k: int,
                           max_n: int = 4, min_n: int = 1) -> Tensor:
    """Extend, then look up, for each of the R rows of a verify of Q queries per row.

    ``hist`` (H, W) the token histories (row ``rows[r]`` holds row r's tokens before the step: positions
    0 .. L - 1, the pending token last); ``ids`` and ``positions`` (R, Q) the verify's query tokens and positions
    (query 0: the pending token at L - 1); ``accept`` (R, Q + 3) its greedy outcome ([m, bonus, path (query
    indices), ..., finite]). Writes the accepted path's tokens and the bonus token at positions L .. L + m of
    the row's history, then returns (R, Q + 4 + k) int64: the outcome row, the chain's length c, and the c
    tokens ``ngram_lookup`` proposes for the extended history (zero-padded to k). A row whose ``rows`` entry is
    -1 (a padded bucket row) is skipped: its output row stays zero."""
    r, q = ids.shape
    out = torch.zeros(r, q + 4 + k, dtype=torch.int64, device=hist.device)
    out[:, :q + 3] = accept
    acc, toks, lens = accept.tolist(), ids.tolist(), (positions[:, 0] + 1).tolist()
    for i, row in enumerate(rows.tolist()):
        if row < 0:
            out[i] = 0
            continue
        m, bonus, L = acc[i][0], acc[i][1], lens[i]
        new = [toks[i][j] for j in acc[i][2:2 + m]] + [bonus]
        hist[row, L:L + m + 1] = torch.tensor(new, dtype=hist.dtype, device=hist.device)
        chain = ngram_lookup(hist[row, :L + m + 1].tolist(), k, max_n, min_n)
        out[i, q + 3] = len(chain)
        out[i, q + 4:q + 4 + len(chain)] = torch.tensor(chain, dtype=torch.int64, device=hist.device)
    return out


@torch.inference_mode()
def ngram_advance_reference(views, b: int, q: int, out: Tensor, tables: Tensor, block_size: int) -> None:
    """Write a next verify into bucket (b, q)'s device ``views``, whole (padding rows and query start locations
    too), from a step's follow-up output: what ``Verifier._graphed`` would pack on the host once that step is
    committed.

    ``out`` (S, q + 4 + k): the follow-up's rows ([m, bonus, path..., finite, c, chain...]) of a verify with q
    queries per row, or (S, q + 3): a verify's outcome alone (no chain: decoding). ``tables`` (b, W + 5) int64,
    per bucket row: its block table, its largest length (prompt + max_new_tokens), the most chain tokens its next
    verify holds (the step's node budget, at most q - 1), its length L at that verify (the pending token at L - 1),
    its row of ``out``, and 1 for a row of the next verify (its first R rows), 0 for padding. Row r's next verify
    is its bonus token at L + m (the pending token), then its chain cut to the budget and to the tokens still to
    come (``NgramDrafter``'s rule: min(c, budget, end - (L + m + 1) - 1)), a causal run. The shapes are the
    buckets', so one capture serves any R and any budget of the bucket. No host reads."""
    dev = out.device
    bt, ends, most, lengths = tables[:, :-5], tables[:, -5], tables[:, -4], tables[:, -3]
    live = (tables[:, -1] > 0)[:, None]  # (b, 1)
    o = out.index_select(0, tables[:, -2])  # (b, q + 4 + k) each row's outcome and chain
    root = lengths + o[:, 0]  # (b,) the bonus token's position: L + m
    k = o.shape[1] - q - 4  # chain columns (-1: an outcome alone)
    found = o[:, q + 3] if k >= 0 else torch.zeros_like(root)  # (b,) the chain's length
    room = (ends - root - 2).clamp(min=0)  # (b,) tokens still to come after the bonus token
    c = torch.minimum(torch.minimum(found, room), most).clamp(max=q - 1)  # (b,) chain tokens kept
    j = torch.arange(q, device=dev)
    valid = (j <= c[:, None]) & live  # (b, q) the bonus token and the kept chain
    chain = torch.cat([o[:, 1:2], o[:, q + 4:q + 4 + min(max(k, 0), q - 1)]], 1)  # the bonus token, then the chain
    if chain.shape[1] < q:  # (a bucket wider than the chain)
        chain = torch.cat([chain, chain.new_zeros(b, q - chain.shape[1])], 1)  # (b, q)
    at = root[:, None] + j  # (b, q) positions of a causal run from the root
    top = bt.shape[1] * block_size - 1
    slots = bt.gather(1, at.clamp(0, top) // block_size) * block_size + at % block_size
    views.ids.view(b, q).copy_(torch.where(valid, chain, 0))
    views.positions.view(b, q).copy_(torch.where(valid, at, 0))
    views.slots.view(b, q).copy_(torch.where(valid, slots, -1))
    views.tree_mask.view(b, q).copy_(torch.where(valid, causal_masks(q, dev), 0))
    views.parents.view(b, q).copy_(torch.where(valid & (j > 0), j - 1, -1))
    per_row = torch.stack([root, root + c + 1, c + 1]) * live.view(1, -1)  # (3, b) prefix, sequence, query lengths
    views.prefix_lens.copy_(per_row[0])
    views.seq_lens.copy_(per_row[1])
    views.num_tokens.copy_(per_row[2])
    views.block_tables.copy_(bt * live)
    views.qsl.copy_(torch.arange(b + 1, device=dev).clamp(max=live.sum()) * q)
