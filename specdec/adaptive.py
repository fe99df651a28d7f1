"""Adaptive speculation: each step's tree budget from measured step costs and running acceptance.

A budget of n nodes for a batch of B rows is worth the tokens it is expected to commit per second,
B * E[n] / C(B, n). E[n] = 1 + sum over k = 1..depth(n) of a_0 * ... * a_(k-1), where a_d is the
running rate at which a row that reached depth d of its tree commits a draft token there (a row
whose tree is too short to reach d counts as a miss, so an n-gram drafter that often proposes
less than asked is valued for what it proposes). C(B, n) = verify forward at (batch bucket, query
bucket of n + 1) + draft forwards * their measured cost + the rest of the step: everything else
``SpecEngine.step`` spends (scheduling, commit, stop checks, routing outputs), measured as the step's
wall time minus drafting and verifying, learned apart for speculative and plain (decode-shaped) steps
because its per-row work differs between them. Budget 0 is
plain decoding (E = 1); a budget is used only when it beats plain decoding by a margin, so
speculation does not make a step slower than target-only decoding by more than the estimates err.

Verify costs are learned online from step wall times (an EMA per (batch bucket, query bucket), host
work included). A bucket not measured yet takes the figure of a measured table
(``GraphRunner.measure_costs`` on CUDA: each captured graph's replay time) plus its batch bucket's
mean offset between online and table figures; without a table it is tried a few times, then
interpolated linearly in the query bucket from the measured ones of its batch bucket. Every
``probe_interval`` steps the next larger budget than the best is used, so that rates of depths the
controller stopped asking for (or acceptance after choosing 0) are measured again. Greedy output
never depends on the budget: every tree verifies to the target's own tokens.
"""

from __future__ import annotations

import bisect
import functools
import time
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

from specdec.errors import FieldError
from specdec.graphs import BATCH_BUCKETS, QUERY_BUCKETS, bucket

OTHER_SPIKE = 3.0  # a step's "other" seconds count at most this many times their running estimate
DYNAMIC_LEVEL_WIDTH_DIVISOR = 6  # ModelDrafter adds max(1, min(DYNAMIC_BEAM_MAX, max_nodes // 6)) nodes per level


class BudgetOption(NamedTuple):
    """One choice of the controller: ``nodes`` allowed in each tree, the ``depth`` such a tree
    reaches, and the draft forwards (model drafters) or lookups (n-gram) that grow it."""

    nodes: int
    depth: int
    draft_forwards: int


@dataclass(frozen=True)
class AdaptiveConfig:
    """prior_rate, prior_weight: the acceptance rate every depth starts at and how many observations
    it counts for (optimistic and light, so speculation starts and the data takes over within a few
    steps); memory: observations a depth's rate averages over; cost_alpha: EMA weight of a new cost
    sample; probe_interval: steps between probes of a larger budget; margin: how much more tokens per
    second a budget must promise than plain decoding; explore_tries: steps an unmeasured bucket is tried."""

    prior_rate: float = 0.8
    prior_weight: float = 2.0
    memory: float = 64.0
    cost_alpha: float = 0.25
    probe_interval: int = 16
    margin: float = 0.03
    explore_tries: int = 1

    def __post_init__(self) -> None:
        for name, lo, hi in (("prior_rate", 0.0, 1.0), ("cost_alpha", 0.0, 1.0), ("margin", 0.0, 1.0)):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise FieldError("AdaptiveConfig", name, f"must be a number in [{lo}, {hi}]", v)
        for name in ("prior_weight", "memory"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v <= 0:
                raise FieldError("AdaptiveConfig", name, "must be a number > 0", v)
        for name in ("probe_interval", "explore_tries"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise FieldError("AdaptiveConfig", name, "must be an int >= 1", v)


def budget_options(drafter) -> list[BudgetOption]:
    """The budgets ``drafter`` can grow, from 0 (plain decoding) to its ``max_nodes``.

    n-gram: chains of 1..K tokens, one lookup. Draft model (the catch-up forward runs even at budget
    0, keeping the draft's KV current): chains of 1..K; a static top-k tree cut after whole levels
    (a prefix of the template in level order: a partly grown level would be valued like a full one);
    a dynamic tree grown level by level, each level as wide as with the full budget. A drafter whose
    device program drafts a whole static template or dynamic tree at once (the graphed eagle path)
    costs one draft step whatever the budget: its trees are cut to the budget afterwards (a dynamic
    tree to its best nodes, ``_best_node_options``)."""
    top = drafter.max_nodes
    spec = getattr(drafter, "spec", None)
    if top == 0:
        return [BudgetOption(0, 0, 0)]
    if not drafter.uses_kv or spec is None:
        return [BudgetOption(0, 0, 0)] + [BudgetOption(k, k, 1) for k in range(1, top + 1)]
    if spec.is_static:
        depth: list[int] = []
        for p in spec.template().parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        levels = [sum(1 for d in depth if d < level) for level in range(1, max(depth) + 2)]
        whole = getattr(drafter, "device_loop", None) is not None  # one device program drafts every level
        return [BudgetOption(0, 0, 1)] + [BudgetOption(n, d, 1 if whole else d) for d, n in enumerate(levels, 1)]
    from specdec.drafters.model_drafter import DYNAMIC_BEAM_MAX

    shape = getattr(getattr(drafter, "device_loop", None), "shape", None)  # a device dynamic tree: one program
    if shape is not None:
        return _best_node_options(shape)
    width = spec.width or max(1, min(DYNAMIC_BEAM_MAX, top // DYNAMIC_LEVEL_WIDTH_DIVISOR))
    out = [BudgetOption(0, 0, 1)]
    for d in range(1, drafter._max_depth + 1):
        out.append(BudgetOption(min(d * width, top), d, d))
        if d * width >= top:
            break
    return out


def _best_node_options(shape) -> list[BudgetOption]:
    """Budgets of a device dynamic tree (one program whatever the budget, ``shape`` = (K, D, N)): its best
    2^d - 1 nodes for d = 1, 2, ... (a verify of 2^d tokens fills its query bucket), valued as depth
    min(d, D), and all N nodes."""
    out, d = [BudgetOption(0, 0, 1)], 1
    while (1 << d) - 1 < shape.nodes:
        out.append(BudgetOption((1 << d) - 1, min(d, shape.depth), 1))
        d += 1
    return out + [BudgetOption(shape.nodes, min(d, shape.depth), 1)]


_BATCH_KEY = [bucket(n, BATCH_BUCKETS) for n in range(max(BATCH_BUCKETS) + 1)]
_QUERY_KEY = [bucket(n, QUERY_BUCKETS) for n in range(max(QUERY_BUCKETS) + 1)]


def template_tree(tokens: list[int], template, n: int):
    """The deterministic tree of ``template`` holding ``tokens``, cut to its first ``n`` nodes in level
    order (the adaptive budget of a drafter that grows whole templates at once; ``n`` >= size: all)."""
    return template_trees([tokens], template, n)[0]


def template_trees(rows: list[list[int]], template, n: int) -> list:
    """``template_tree`` of every token list in ``rows`` (a batch's trees), the cut shape looked up once."""
    from specdec.tree import DraftTree

    if n >= template.num_nodes:
        return DraftTree.of_template_rows(rows, template)
    if not n:
        return [DraftTree.empty()] * len(rows)
    return DraftTree.of_template_rows([tokens[:n] for tokens in rows], _template_prefix(template.parents, n))


def max_nodes(trees) -> int:
    """Nodes of the largest of ``trees`` (``trees.num_nodes`` when the batch knows it: ``FusedTrees``, whose
    trees are then not built)."""
    known = getattr(trees, "num_nodes", None)
    return known if known is not None else max((t.num_nodes for t in trees), default=0)


@functools.lru_cache(maxsize=256)
def _template_prefix(parents: tuple[int, ...], n: int):
    from specdec.tree_spec import TreeTemplate

    return TreeTemplate(parents[:n])


def batch_key(rows: int) -> int:
    """The cost-table batch bucket of ``rows`` rows (the rows themselves past the largest bucket)."""
    return _BATCH_KEY[rows] if rows < len(_BATCH_KEY) else rows


def query_key(tokens: int) -> int:
    """The cost-table query bucket of a verify row of ``tokens`` tokens."""
    return _QUERY_KEY[tokens] if tokens < len(_QUERY_KEY) else tokens


class DepthAcceptance:
    """Running rate per depth at which a row that reached depth d commits a draft token there."""

    def __init__(self, max_depth: int, prior: float, weight: float, memory: float) -> None:
        self.rates = [float(prior)] * max_depth
        self.weights = [float(weight)] * max_depth
        self.memory = memory

    def observe(self, offered_depth: int, accepted: list[int]) -> None:
        """One step: ``accepted[i]`` draft tokens of row i were accepted, trees at most ``offered_depth`` deep."""
        D = min(offered_depth, len(self.rates))
        reach, hit = [0] * (D + 1), [0] * (D + 1)
        for m, rows in Counter(accepted).items():
            reach[min(m + 1, D)] += rows
            hit[min(m, D)] += rows
        attempts = hits = 0
        for d in range(D - 1, -1, -1):  # rows that reached depth d: reach index > d (suffix sums)
            attempts += reach[d + 1]
            hits += hit[d + 1]
            if attempts:
                w = min(self.weights[d], self.memory)
                self.rates[d] = (self.rates[d] * w + hits) / (w + attempts)
                self.weights[d] = w + attempts

    def expected(self) -> list[float]:
        """E[depth] for depth 0..max_depth: tokens committed per row by a tree that deep."""
        out, p = [1.0], 1.0
        for a in self.rates:
            p *= a
            out.append(out[-1] + p)
        return out


class StepCosts:
    """Seconds of a step's parts per batch bucket: verify forwards per query bucket, a draft forward
    (or lookup), and the rest of the step. A verify bucket measured online is its EMA (host work
    included); one not yet measured is the table's figure plus the batch bucket's mean offset
    between measured and table figures, or else interpolated from the measured buckets."""

    def __init__(self, alpha: float, table: dict[tuple[int, int], float] | None = None) -> None:
        self.alpha = alpha
        self.table = dict(table or {})
        self.seen: dict[tuple[int, int], float] = {}
        self.offset: dict[int, float] = {}  # measured - table, per batch bucket
        self.draft: dict[int, float] = {}  # one draft forward or lookup
        self.other: dict[tuple[int, bool], float] = {}  # (batch bucket, speculative) -> rest of the step
        self.tries: Counter = Counter()

    def _ema(self, store: dict, key, value: float) -> None:
        store[key] = value if key not in store else store[key] + self.alpha * (value - store[key])

    def known(self, b: int, q: int) -> bool:
        return (b, q) in self.table or (b, q) in self.seen

    def verify(self, b: int, q: int) -> float | None:
        """Estimated seconds of a verify forward at (b, q); None when nothing at batch bucket b is known."""
        if (b, q) in self.seen:
            return self.seen[(b, q)]
        if (b, q) in self.table:
            return max(self.table[(b, q)] + self.offset.get(b, 0.0), 1e-9)
        pts = sorted((qq, c) for (bb, qq), c in self.seen.items() if bb == b)
        if not pts:
            return None
        if q <= pts[0][0] or len(pts) == 1:  # below the seen range, or one point: flat
            return pts[0][1]
        i = min(bisect.bisect_left([p[0] for p in pts], q), len(pts) - 1)
        (q0, c0), (q1, c1) = pts[i - 1], pts[i]
        return c0 + max((c1 - c0) / (q1 - q0), 0.0) * (q - q0)  # linear; past the last point, its slope

    def step(self, b: int, q: int, draft_forwards: int) -> float | None:
        """Estimated seconds of a whole step at (b, q) with ``draft_forwards`` draft forwards; None if unknown."""
        v = self.verify(b, q)
        if v is None:
            return None
        other = self.other.get((b, q > 1), 0.0)  # a kind not measured yet looks cheap: it is tried, then known
        return v + self.draft.get(b, 0.0) * draft_forwards + other

    def observe_verify(self, b: int, q: int, seconds: float) -> None:
        self._ema(self.seen, (b, q), seconds)
        if (b, q) in self.table:
            self._ema(self.offset, b, seconds - self.table[(b, q)])

    def observe_draft(self, b: int, forwards: int, seconds: float) -> None:
        if forwards:
            self._ema(self.draft, b, seconds / forwards)

    def observe_other(self, b: int, seconds: float, speculative: bool) -> None:
        """A step's seconds outside drafting and verifying, clipped at ``OTHER_SPIKE`` x the estimate: a step
        in which requests finish pays their final detokenisation, whatever its budget."""
        key = (b, speculative)
        if key in self.other:
            seconds = min(seconds, OTHER_SPIKE * self.other[key])
        self._ema(self.other, key, seconds)


class BudgetController:
    """Chooses each step's tree budget (``choose``) and learns from the step (``observe``)."""

    def __init__(self, options: list[BudgetOption], config: AdaptiveConfig | None = None,
                 cost_table: dict[tuple[int, int], float] | None = None,
                 query_buckets: tuple[int, ...] = QUERY_BUCKETS) -> None:
        self.config = cfg = config or AdaptiveConfig()
        self._query_of = [bucket(n, query_buckets) for n in range(max(query_buckets) + 1)]
        self.options = undominated(options, self.query_key)
        self._query = [self.query_key(o.nodes + 1) for o in self.options]
        self._explored: set[int] = set()  # batch buckets whose every option bucket is known or was tried
        self.acceptance = DepthAcceptance(max(o.depth for o in self.options), cfg.prior_rate, cfg.prior_weight,
                                          cfg.memory)
        self.costs = StepCosts(cfg.cost_alpha, cost_table)
        self.chosen: Counter = Counter()  # (rows, nodes) -> steps
        self.last = self.options[-1]
        self._after_plain = False  # the step before the last chosen one had budget 0
        self.timing_valid = True  # False: this step's wall times are not the step's own (the engine ran a prefill)
        self._steps = 0
        self._timed: tuple[int, bool, float] | None = None  # last speculate: batch bucket, speculative, seconds

    def query_key(self, tokens: int) -> int:
        """The cost-table query bucket of a verify row of ``tokens`` tokens (the graphs' buckets when graphed)."""
        return self._query_of[tokens] if tokens < len(self._query_of) else tokens

    def choose(self, rows: int) -> int:
        """The node budget of a step over ``rows`` speculating rows."""
        b = batch_key(rows)
        self._steps += 1
        self._after_plain = self.last.nodes == 0
        self.last = self._explore(b) or self._best(b)
        self.chosen[(rows, self.last.nodes)] += 1
        return self.last.nodes

    def _explore(self, b: int) -> BudgetOption | None:
        if not self.timing_valid or b in self._explored:  # (a step with a prefill would not measure it)
            return None
        for o, q in zip(reversed(self.options), reversed(self._query)):
            if not self.costs.known(b, q) and self.costs.tries[(b, q)] < self.config.explore_tries:
                self.costs.tries[(b, q)] += 1
                return o
        self._explored.add(b)
        return None

    def _best(self, b: int) -> BudgetOption:
        expected = self.acceptance.expected()
        values = []
        for o, q in zip(self.options, self._query):
            c = self.costs.step(b, q, o.draft_forwards)
            values.append(-1.0 if c is None else expected[o.depth] / c)
        best = max(range(1, len(values)), key=values.__getitem__, default=0)
        if values[0] >= 0 and values[best] <= values[0] * (1 + self.config.margin):
            best = 0
        if values[best] < 0:
            best = len(values) - 1
        if self._steps % self.config.probe_interval == 0 and best + 1 < len(self.options):
            best += 1
        return self.options[best]

    def speculate(self, rows: list, proposer, verifier) -> list:
        """One propose -> verify step of ``rows`` under the budget chosen for them (``proposer.budget``: the drafter,
        or the pipeline wrapped around it); learns from its timings."""
        proposer.budget = self.choose(len(rows))
        t0 = time.perf_counter()
        proposal = proposer.propose(rows)
        t1 = time.perf_counter()
        results = verifier.verify_proposal(rows, proposal)
        t2 = time.perf_counter()
        seconds = None if proposal.device is None else proposal.device.draft_seconds
        if seconds is not None:  # the draft program ran on the device, timed there: split the step at its share
            t1 = t0 + min(seconds, t2 - t0)
        query = 1 + max_nodes(proposal.trees)
        self.observe(len(rows), query, [len(r.accepted_nodes) for r in results], t1 - t0, t2 - t1)
        self._timed = (batch_key(len(rows)), query > 1, t2 - t0)
        return results

    def observe(self, rows: int, query: int, accepted: list[int], propose_s: float, verify_s: float) -> None:
        """Learn from the step ``choose`` was last asked for: ``query`` = tokens of the longest verify row,
        ``accepted[i]`` = draft tokens accepted in row i, and the seconds drafting and verifying took."""
        b = batch_key(rows)
        if self.timing_valid:
            self.costs.observe_verify(b, self.query_key(query), verify_s)
            if not self._after_plain:  # the first proposal after plain steps catches up on their tokens
                self.costs.observe_draft(b, self.last.draft_forwards, propose_s)
        if self.last.depth:
            self.acceptance.observe(self.last.depth, accepted)

    def observe_step(self, seconds: float) -> None:
        """Wall seconds of the whole engine step whose rows ``speculate`` ran last (scheduling to routed
        outputs): what it spent outside drafting and verifying is learned for its batch bucket and kind
        (speculative: some tree had nodes; else decode-shaped)."""
        timed, self._timed = self._timed, None
        if timed is not None and self.timing_valid:
            b, speculative, inner = timed
            self.costs.observe_other(b, max(seconds - inner, 0.0), speculative)

    def mean_budget(self, rows: int | None = None, since: Counter | None = None) -> float | None:
        """Mean chosen budget over steps of ``rows`` rows (all steps when None), counted after the
        ``since`` snapshot of ``chosen``; None when there were none."""
        return mean_budget(self.chosen, rows, since)


def mean_budget(chosen: Counter, rows: int | None = None, since: Counter | None = None) -> float | None:
    """Mean budget of the steps counted in ``chosen`` ((rows, nodes) -> steps) over steps of ``rows`` rows (all
    steps when None), counted after the ``since`` snapshot; None when there were none."""
    counts = chosen - (since or Counter())
    picked = [(n, c) for (r, n), c in counts.items() if rows is None or r == rows]
    steps = sum(c for _, c in picked)
    return sum(n * c for n, c in picked) / steps if steps else None


def undominated(options: list[BudgetOption], query_key=query_key) -> list[BudgetOption]:
    """Options sorted by nodes, keeping the deepest of those that share a query bucket (``query_key``)
    and a draft cost (they cost the same, and a deeper tree commits at least as much)."""
    best: dict[tuple[int, int], BudgetOption] = {}
    for o in options:
        key = (query_key(o.nodes + 1), o.draft_forwards)
        if key not in best or (o.depth, o.nodes) > (best[key].depth, best[key].nodes):
            best[key] = o
    return sorted(best.values())
