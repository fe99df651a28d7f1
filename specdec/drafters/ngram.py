"""Model-free drafting by prompt lookup: continue the latest earlier occurrence of the suffix.

A request looks first in its own text (prompt and output). With a ``SharedNgrams`` table a greedy request
also looks in the text of every request the drafter has seen (running or finished): a longer match there
wins over a shorter own match, so phrases another reply already produced can be proposed: replies to related
prompts repeat each other, and a longer match is accepted further.
"""

from __future__ import annotations

import numpy as np

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


def ngram_lookup_array(tokens, k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """``ngram_lookup``'s result by numpy over the whole text (a list or an int array), without an index: one pass in
    C finds the earlier positions of the last token, and each longer suffix only filters those."""
    L = len(tokens)
    if L < 2 or k < 1:
        return []
    a = np.asarray(tokens, dtype=np.int64)
    ends = np.flatnonzero(a[:L - 1] == a[L - 1])  # where an earlier match would end (each followed by a token)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        e = ends[ends >= n - 1]
        for j in range(1, n):
            e = e[a[e - j] == a[L - 1 - j]]
        if e.size:
            end = int(e[-1])
            return a[end + 1:end + 1 + k].tolist()
    return []


class SharedNgrams:
    """The latest occurrence of every n-gram (``min_n`` <= n tokens) in the text of all requests that
    indexed into it: n-gram -> (that request's token list, start). Token lists only grow, so an entry stays
    valid. Bounded: when ``capacity`` n-grams have been written since the last turn-over, the newest
    generation becomes the old one and the generation before is dropped (with its token lists).

    An entry is stored as one int, owner << 32 | start, with the owners' token lists in a per-generation
    dict: ints are not tracked by the cyclic garbage collector, while (list, int) tuples are; with them the
    table's growth set off a full collection of the engine's heap (~170 ms with 370k objects) every other
    80-prompt run."""

    def __init__(self, min_n: int = 2, capacity: int = 1 << 19) -> None:
        if min_n < 1 or capacity < 1:
            raise ValueError(f"need min_n >= 1 and capacity >= 1, got min_n={min_n}, capacity={capacity}")
        self.min_n, self.capacity = min_n, capacity
        self.new: dict[tuple[int, ...], int] = {}  # n-gram -> owner << 32 | start
        self.old: dict[tuple[int, ...], int] = {}
        self.new_owners: dict[int, list[int]] = {}  # owner -> its token list, for the entries of ``new``
        self.old_owners: dict[int, list[int]] = {}
        self._owners = 0

    def owner(self) -> int:
        """A new owner id (one per request's index)."""
        self._owners += 1
        return self._owners

    def writer(self, owner: int, tokens: list[int]) -> dict[tuple[int, ...], int]:
        """The newest generation's table, with ``tokens`` registered as ``owner``'s list."""
        if owner not in self.new_owners:
            self.new_owners[owner] = tokens
        return self.new

    def get(self, gram: tuple[int, ...]) -> tuple[list[int], int] | None:
        """(token list, start) of the latest occurrence of ``gram``, or None."""
        found, owners = self.new.get(gram), self.new_owners
        if found is None:
            found, owners = self.old.get(gram), self.old_owners
            if found is None:
                return None
        return owners[found >> 32], found & 0xFFFFFFFF

    def follow(self, probes, k: int) -> list[int] | None:
        """The up to ``k`` tokens after the latest occurrence of the first n-gram of ``probes`` ((n, n-gram)
        pairs, longest first) that the table holds, or None when it holds none of them. ``get`` inlined: it runs
        up to max_n times per row-step."""
        new, old = self.new, self.old
        for n, gram in probes:
            hit = new.get(gram)
            if hit is not None:
                owners = self.new_owners
            elif old and (hit := old.get(gram)) is not None:  # ``old`` is empty until the first turn-over
                owners = self.old_owners
            else:
                continue
            start = hit & 0xFFFFFFFF
            return owners[hit >> 32][start + n:start + n + k]
        return None

    def clear(self) -> None:
        self.new, self.old, self.new_owners, self.old_owners = {}, {}, {}, {}

    def turn_over(self) -> None:
        """Start a new generation once the newest holds ``capacity`` n-grams."""
        if len(self.new) >= self.capacity:
            self.old, self.new = self.new, {}
            self.old_owners, self.new_owners = self.new_owners, {}


class NgramIndex:
    """``ngram_lookup`` for one growing token list in O(max_n) per call: for every n it remembers the
    latest start of each n-gram that is followed by at least one token, updated as tokens arrive
    (tokens are only ever appended). With ``shared``, its n-grams of at least ``shared.min_n`` tokens go
    there too, and a lookup takes a longer match from there over a shorter one of its own."""

    def __init__(self, max_n: int, min_n: int = 1, shared: SharedNgrams | None = None) -> None:
        self.max_n, self.min_n, self.shared = max_n, min_n, shared
        self.owner = 0 if shared is None else shared.owner()  # this index's id in the shared table
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram (min_n <= n <= max_n) -> its latest start
        self.indexed = 0  # n-grams ending before this position are in ``latest``
        self.unrolled = self.unrolled_shape(max_n, min_n, shared)
        self._grams, self._grams_at = (), -1  # lookup_unrolled: the 4..1-grams ending at _grams_at (its last suffix)

    @staticmethod
    def unrolled_shape(max_n: int, min_n: int, shared: SharedNgrams | None) -> bool:
        """Whether ``lookup_unrolled`` serves indexes of this shape (max_n 4, min_n 1; a shared table of min_n 2
        or none): the n-gram drafter's default."""
        return max_n == 4 and min_n == 1 and (shared is None or shared.min_n == 2)

    def update(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams of ``tokens`` that end before position ``upto`` (each is followed by a token).

        For each n, the n-grams ending at ``indexed``..``upto`` - 1 go in with one ``dict.update`` over zipped
        slices, so the tuples and the insertions run in C: a prompt's indexing (a prefill step's host work) costs a
        few operations per token instead of a Python loop iteration. Starts rise within each n, so an n-gram seen
        twice keeps its latest start, as in a token-by-token walk."""
        first = self.indexed
        if upto <= first:
            return
        latest, shared = self.latest, self.shared
        new, s_lo, tag = None, 0, self.owner << 32  # a shared entry is tag | start = tag + start
        if shared is not None:
            new, s_lo = shared.writer(self.owner, tokens), shared.min_n
        for n in range(self.min_n, self.max_n + 1):
            lo = max(first, n)  # the first end of an n-gram: n tokens before it
            if lo >= upto:
                continue
            grams = zip(*(tokens[lo - n + j:upto - n + j] for j in range(n)))
            if new is not None and n >= s_lo:
                grams = list(grams)
                new.update(zip(grams, range(tag + lo - n, tag + upto - n)))
            latest.update(zip(grams, range(lo - n, upto - n)))
        if new is not None and len(new) >= shared.capacity:
            shared.turn_over()
        self.indexed = upto

    def lookup(self, tokens: list[int], k: int, use_shared: bool = True) -> list[int]:
        """Same result as ``ngram_lookup(tokens, k, max_n, min_n)`` without ``shared`` (or ``use_shared``
        False); with it, the continuation of a longer suffix match in the shared table when there is one."""
        L, lo, hi, latest = len(tokens), self.min_n, self.max_n, self.latest
        if L > self.indexed:
            self.update(tokens, L)
        top = hi if hi < L - 1 else L - 1
        if top < lo:
            return []
        suffix = tuple(tokens[L - top:])
        found, out = lo - 1, []
        if lo > 1 or (tokens[-1],) in latest:  # else no earlier occurrence of the last token
            for n in range(top, lo - 1, -1):
                start = latest.get(suffix[top - n:])
                if start is not None:
                    found, out = n, tokens[start + n:start + n + k]
                    break
        shared = self.shared
        if shared is not None and use_shared:
            longer = range(top, max(found, shared.min_n - 1), -1)  # longer than the own match only
            hit = shared.follow(((n, suffix[top - n:]) for n in longer), k)
            if hit is not None:
                return hit
        return out

    def lookup_unrolled(self, tokens: list[int], k: int, use_shared: bool = True) -> list[int]:
        """``lookup`` for the drafter's default shape (``unrolled``: max_n 4, min_n 1, a shared table of
        min_n 2 or none) with ``update`` inlined: the same continuation and the same table entries, in one
        call per row-step instead of three (the n-gram step's largest host cost)."""
        L, latest, first, shared = len(tokens), self.latest, self.indexed, self.shared
        if L < 5 or first < 4 or L < first:  # a suffix shorter than max_n, the list's first n-grams, or a cut list
            self._grams_at = -1
            return self.lookup(tokens, k, use_shared)
        b, c, d = tokens[first - 3:first]
        if self._grams_at == first:  # the n-grams ending at ``first``: the last lookup's suffix
            g4, g3, g2, g1 = self._grams
        else:
            g4, g3, g2, g1 = (tokens[first - 4], b, c, d), (b, c, d), (c, d), (d,)
        if L > first:  # ``update``'s unrolled loop; it ends with the suffix's n-grams (ending at L)
            s = first - 4  # the start of the 4-gram ending at ``end``, for end = first, first + 1, ...
            if shared is None:
                for x in tokens[first:L]:  # x = tokens[end], the token after the n-grams ending at end
                    latest[g4], latest[g3], latest[g2], latest[g1] = s, s + 1, s + 2, s + 3
                    g4, g3, g2, g1 = (b, c, d, x), (c, d, x), (d, x), (x,)
                    b, c, d, s = c, d, x, s + 1
            else:
                new, owners = shared.new, shared.new_owners
                if self.owner not in owners:
                    owners[self.owner] = tokens
                t = (self.owner << 32) + s
                for x in tokens[first:L]:
                    latest[g4], latest[g3], latest[g2], latest[g1] = s, s + 1, s + 2, s + 3
                    new[g4], new[g3], new[g2] = t, t + 1, t + 2
                    g4, g3, g2, g1 = (b, c, d, x), (c, d, x), (d, x), (x,)
                    b, c, d, s, t = c, d, x, s + 1, t + 1
                if len(new) >= shared.capacity:
                    shared.turn_over()
            self.indexed = L
        self._grams, self._grams_at, found = (g4, g3, g2, g1), L, 0
        start = latest.get(g1)  # None: no earlier occurrence of the last token
        if start is not None:  # the longest own match (``lookup``'s loop over n, unrolled)
            if (s4 := latest.get(g4)) is not None:
                found, start = 4, s4
            elif (s3 := latest.get(g3)) is not None:
                found, start = 3, s3
            elif (s2 := latest.get(g2)) is not None:
                found, start = 2, s2
            else:
                found = 1
        out = tokens[start + found:start + found + k] if found else []
        if shared is not None and use_shared and found < 4:  # a longer match in the shared table wins
            hit = shared.follow(_SHARED_PROBES[found](g4, g3, g2), k)
            if hit is not None:
                return hit
        return out


# ``lookup_unrolled``'s shared-table probes after an own match of n tokens: the longer n-grams (of at least 2 tokens)
_SHARED_PROBES = (lambda g4, g3, g2: ((4, g4), (3, g3), (2, g2)), lambda g4, g3, g2: ((4, g4), (3, g3), (2, g2)),
                  lambda g4, g3, g2: ((4, g4), (3, g3)), lambda g4, g3, g2: ((4, g4),))


class NgramDrafter(Drafter):
    """Chains of up to ``k`` tokens drawn from the prompt and the generated text (point-mass drafts);
    ``shared``: greedy rows also draw from every other request's text (``SharedNgrams``)."""

    uses_kv = False
    free_chains = True  # a chain is a host lookup (``free_chain``)

    def __init__(self, k: int = 8, max_n: int = 4, min_n: int = 1, device="cpu", shared: bool = True) -> None:
        if not 1 <= k <= 63:
            raise ValueError(f"ngram k must be in [1, 63], got {k}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.k, self.max_n, self.min_n, self.device = k, max_n, min_n, device
        # n-grams of 2+ tokens across requests (1-token matches elsewhere are mostly noise)
        self.shared = SharedNgrams(min_n=max(2, min_n)) if shared and max_n >= 2 else None
        self.max_nodes = k
        self.unrolled = NgramIndex.unrolled_shape(max_n, min_n, self.shared)  # its indexes take lookup_unrolled
        self._index: dict[Request, NgramIndex] = {}  # requests (identity-hashed) -> their index
        self._texts: dict[Request, tuple[np.ndarray, int]] = {}  # requests -> a copy of their text (``free_chain``)
        self._prune_at = {"index": 64, "texts": 64}  # each table's size at which its ended requests are dropped
        self.device_chains = None  # a ``DeviceNgram`` (the engine sets it): chains looked up on the device

    @property
    def lookahead(self) -> int:
        """Pipelined, a step is queued before the previous one's accepted tokens and bonus token (at most k + 1)
        are committed, so its rows reserve that much more."""
        return self.max_nodes + (self.max_nodes + 1 if self.pipelined else 0)

    def forget(self) -> None:
        """Empty the shared table (requests' own indexes stay: they only hold their own text)."""
        if self.shared is not None:
            self.shared.clear()

    @property
    def device_only(self) -> bool:
        """Every step's chains come from the device lookups (``DeviceNgram`` from one row on: pipelined, or
        ``ngram_device=True``): the host indexes no text, and a row the device has no current chain for (its first
        step, or the first after decode steps, which run no lookup) proposes none that step. Host indexing costs
        about a microsecond per token in Python, on the step's critical path: a prefill step indexing its prompts
        cost more than its forward."""
        return self.device_chains is not None and self.device_chains.min_rows <= 1

    def _device_served(self, rows: list[Request], k: int) -> bool:
        """The chains of a step over ``rows`` come from the device: ``device_only``, and the follow-up runs behind
        a verify of chains of ``k`` tokens (``DeviceNgram.serves``); else the step looks its chains up on the host,
        as before ``device_only``."""
        return self.device_only and self.device_chains.serves(rows, k + 1)

    def first_chain(self, req: Request, k: int) -> list[int]:
        """The chain of a row whose prefill just ended (``pipeline_hooks.ChainAhead`` joins it to a queued step): none
        when the device serves it (its history is uploaded as it joins and the queued step's follow-up looks up its
        next chain), else the host's."""
        return [] if self._device_served([req], k) else self.host_chain(req, k)

    def prefill(self, chunks) -> None:
        """Index the prompt as it is prefilled, so a request's first proposal (a timed step the adaptive
        controller learns the lookup cost from) does not index the whole prompt; nothing when ``device_only``
        (a row that steps on the host after all is indexed at its first lookup)."""
        if self.device_only:
            return
        for c in chunks:
            index = self._index_of(c.req)
            index.update(c.req.tokens, min(c.end + 1, len(c.req.tokens)))

    def _index_of(self, req: Request) -> NgramIndex:
        """``req``'s index, made on first use; indexes of requests that ended (finished, aborted or failed)
        are dropped once the table has doubled since the last clean-up."""
        index = self._index.get(req)
        if index is None:
            self._prune("index", self._index)
            index = self._index[req] = NgramIndex(self.max_n, self.min_n, self.shared)
        return index

    def _prune(self, name: str, table: dict) -> None:
        """Drop the entries of requests that ended (finished, aborted or failed) from ``table`` (one of this
        drafter's per-request tables, ``name`` in ``_prune_at``) once it has doubled since its last clean-up."""
        if len(table) >= self._prune_at[name]:
            for old in [r for r in table if r.finished]:
                del table[old]
            self._prune_at[name] = 2 * len(table) + 64

    def accepted(self, rows: list[Request], results) -> None:
        if self.device_chains is not None:
            self.device_chains.committed(rows)

    def propose(self, rows: list[Request]) -> Proposal:
        """A chain of at most ``node_budget`` tokens per row (empty chains without a lookup when it is 0)."""
        k, n = self.node_budget, len(rows)
        device = self.device_chains
        if k == 0:
            return Proposal([DraftTree.empty()] * n, [None] * n)
        ahead, drafts = device.chains if device is not None else {}, []
        served = self._device_served(rows, k)
        for req in rows:
            hit = ahead.get(req)
            if hit is not None and hit[0] == len(req.tokens):  # looked up on the device after the last step
                drafts.append(hit[1][:_most(req, k)])
            else:
                drafts.append([] if served else self.host_chain(req, k))
        # host trees: verification reads their host view (a queued step adopted in their place verified these chains)
        return Proposal(DraftTree.chains(drafts), [None] * n)

    def free_chain(self, req: Request, k: int) -> list[int]:
        """``req``'s chain from its own text (``ngram_lookup``, as the device lookups of ``ngram_device`` give), by
        whole-array comparisons over a copy of the text kept per request (extended by the tokens since its last
        lookup; copies of requests that ended are dropped once their number has doubled): no index is kept, so a
        row looked up now and then costs O(its length) in C."""
        buf, filled = self._texts.get(req, (None, 0))
        n = len(req.tokens)
        if buf is None or buf.size < n:
            if buf is None:
                self._prune("texts", self._texts)
            grown = np.empty(max(2 * n, 256), dtype=np.int64)
            if filled:
                grown[:filled] = buf[:filled]
            buf = grown
        if n > filled:
            buf[filled:n] = req.tokens[filled:n]
        self._texts[req] = (buf, n)
        return ngram_lookup_array(buf[:n], _most(req, k), self.max_n, self.min_n)

    def host_chain(self, req: Request, k: int) -> list[int]:
        """``req``'s chain of at most ``k`` tokens (and of the tokens still to come) looked up on the host."""
        index = self._index.get(req) or self._index_of(req)
        lookup = NgramIndex.lookup_unrolled if self.unrolled else NgramIndex.lookup  # every index has this shape
        # a sampled row's draft decides which uniforms its seed spends: from its own text only, its seeded output
        # does not depend on what else the engine has served
        return lookup(index, req.tokens, _most(req, k), req.params.greedy)


def _most(req: Request, k: int) -> int:
    """The most chain tokens ``req`` may be proposed: ``k``, cut to the tokens still to come after the bonus token."""
    room = req.params.max_new_tokens + len(req.prompt_ids) - len(req.tokens) - 1
    return k if room >= k else max(room, 0)
