"""Model-free drafting by prompt lookup: continue the latest earlier occurrence of the suffix."""

from __future__ import annotations

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

    def update(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams of ``tokens`` that end before position ``upto`` (each is followed by a token)."""
        lo, hi, latest = self.min_n, self.max_n, self.latest
        for end in range(self.indexed, upto):  # every n-gram ending at ``end`` is followed by tokens[end]
            tail = tuple(tokens[end - hi if end > hi else 0:end])
            for n in range(lo, len(tail) + 1):
                latest[tail[-n:]] = end - n
        if upto > self.indexed:
            self.indexed = upto

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Same result as ``ngram_lookup(tokens, k, max_n, min_n)``."""
        L, lo, hi, latest = len(tokens), self.min_n, self.max_n, self.latest
        if L > self.indexed:
            self.update(tokens, L)
        top = hi if hi < L - 1 else L - 1
        if top < lo or (lo == 1 and (tokens[-1],) not in latest):  # no earlier occurrence of the last token
            return []
        suffix = tuple(tokens[L - top:])
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
        self._index: dict[Request, NgramIndex] = {}  # requests (identity-hashed) -> their index
        self._prune_at = 64

    def prefill(self, chunks, features=None) -> None:
        """Index the prompt as it is prefilled, so a request's first proposal (a timed step the adaptive
        controller learns the lookup cost from) does not index the whole prompt."""
        for c in chunks:
            index = self._index_of(c.req)
            index.update(c.req.tokens, min(c.end + 1, len(c.req.tokens)))

    def _index_of(self, req: Request) -> NgramIndex:
        """``req``'s index, made on first use; indexes of requests that ended (finished, aborted or failed)
        are dropped once the table has doubled since the last clean-up."""
        index = self._index.get(req)
        if index is None:
            if len(self._index) >= self._prune_at:
                for old in [r for r in self._index if r.finished]:
                    del self._index[old]
                self._prune_at = 2 * len(self._index) + 64
            index = self._index[req] = NgramIndex(self.max_n, self.min_n)
        return index

    def propose(self, rows: list[Request]) -> Proposal:
        """A chain of at most ``node_budget`` tokens per row (empty chains without a lookup when it is 0)."""
        k, n = self.node_budget, len(rows)
        if k == 0:
            return Proposal([DraftTree.empty()] * n, [None] * n)
        indexes, chain, trees = self._index, DraftTree.chain, []
        for req in rows:
            index = indexes.get(req) or self._index_of(req)
            room = req.params.max_new_tokens + len(req.prompt_ids) - len(req.tokens) - 1  # tokens still to come
            trees.append(chain(index.lookup(req.tokens, k if room >= k else max(room, 0))))
        return Proposal(trees, [None] * n)  # host trees: verification reads tokens from the host view
