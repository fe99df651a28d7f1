"""Model-free drafting by prompt lookup: continue the latest earlier occurrence of the suffix."""

from __future__ import annotations

import weakref

from specdec.drafters.base import Drafter, Proposal
from specdec.scheduler.request import Request
from specdec.tree import DraftTree


def ngram_lookup(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier match of the longest suffix n-gram."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


class NgramIndex:
    """``ngram_lookup`` for one growing token list in O(max_n) per call: for every n it remembers the
    latest start of each n-gram that is followed by at least one token, updated as tokens arrive
    (tokens are only ever appended)."""

    def __init__(self, max_n: int, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram (min_n <= n <= max_n) -> its latest start
        self.indexed = 0  # n-grams ending before this position are in ``latest``

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Same result as ``ngram_lookup(tokens, k, max_n, min_n)``."""
        L, lo, hi, latest = len(tokens), self.min_n, self.max_n, self.latest
        for end in range(self.indexed, L):  # every n-gram ending at ``end`` is followed by tokens[end]
            tail = tuple(tokens[max(0, end - hi):end])
            for n in range(lo, len(tail) + 1):
                latest[tail[len(tail) - n:]] = end - n
        self.indexed = max(self.indexed, L)
        top = min(hi, L - 1)
        suffix = tuple(tokens[L - top:]) if top > 0 else ()
        for n in range(top, lo - 1, -1):
            start = latest.get(suffix[top - n:])
            if start is not None:
                return tokens[start + n:start + n + k]
        return []


class NgramDrafter(Drafter):
    """Chains of up to ``k`` tokens drawn from the prompt and the generated text (point-mass drafts)."""

    uses_kv = False

    def __init__(self, k: int = 8, max_n: int = 4, min_n: int = 1, device="cpu") -> None:
        if not 1 <= k <= 63:
            raise ValueError(f"ngram k must be in [1, 63], got {k}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.k, self.max_n, self.min_n, self.device = k, max_n, min_n, device
        self.max_nodes = k
        self._index: weakref.WeakKeyDictionary[Request, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, rows: list[Request]) -> Proposal:
        """A chain of at most ``node_budget`` tokens per row (empty chains without a lookup when it is 0)."""
        k = self.node_budget
        if k == 0:
            return Proposal([DraftTree.chain([]) for _ in rows], [None] * len(rows))
        trees = []
        for req in rows:
            room = req.params.max_new_tokens - req.num_output - 1
            index = self._index.get(req)
            if index is None:
                index = self._index[req] = NgramIndex(self.max_n, self.min_n)
            cand = index.lookup(req.tokens, min(k, max(room, 0)))
            trees.append(DraftTree.chain(cand))  # host trees: verification reads tokens from the host view
        return Proposal(trees, [None] * len(rows))
