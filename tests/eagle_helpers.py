"""What an EAGLE engine's steps commit, with the target features kept in the committed tokens' slots."""

from __future__ import annotations

import numpy as np


def record_commits(eng, steps: list) -> None:
    """Append to ``steps``, at each commit of ``eng``, one entry per row: (its ``VerifyResult``, the target features
    (m + 1, k * H) the pool holds for its pending token and accepted path once they are committed: what the
    draft's next catch-up reads)."""
    commit, pool = eng._commit, eng.pool

    def spy(rows, results):
        starts = [len(r.tokens) - 1 for r in rows]
        blocks = [list(r.blocks) for r in rows]  # (a finished row's blocks are freed, but not rewritten, at commit)
        commit(rows, results)
        step = []
        for res, start, bl in zip(results, starts, blocks):
            pos = np.arange(start, start + len(res.accepted_nodes) + 1)
            rows_ = pool.feature_rows(np.asarray([bl], dtype=np.int64), pos[None])[0]
            step.append((res, pool.features[rows_].tolist()))
        steps.append(step)

    eng._commit = spy
