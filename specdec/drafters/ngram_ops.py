"""Torch reference of the device n-gram step (``kernels/ngram_follow.py`` is the one-launch Triton version): a
graphed verify's greedy outcome extends each row's token history in a device buffer, and the row's next chain
is looked up there with the semantics of ``specdec.drafters.ngram.ngram_lookup``.

Kept apart from ``specdec.drafters.ngram_device`` (which drives it) so the attention backends, which dispatch
it, import it without importing the drafters' machinery.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.drafters.ngram import ngram_lookup


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
