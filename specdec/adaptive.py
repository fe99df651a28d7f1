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
import math
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
    from specdec.tree import TreeTemplate

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
        self.options = _undominated(options, self.query_key)
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


@dataclass(frozen=True)
class EpochConfig:
    """epoch_steps, epoch_rows: an epoch (the steps a budget is held before it is judged) ends once it timed at
    least epoch_steps steps over at least epoch_rows rows in all (a small batch's tokens per step vary with the
    text, so its epochs run longer); hold_epochs: epochs the best budget is held before a neighbour is probed,
    doubled after each probe that leaves the best where it is (up to max_hold_epochs) and reset when the best
    moves; margin: how much more tokens per second a budget must measure than the one held, and than plain
    decoding (budget 0), to be held instead; alpha: weight of a new epoch's rate against the budget's earlier
    ones; max_epoch_steps: steps after which an epoch ends however few of them were timed (steps that ran a
    prefill are not); first_row_steps, first_min_steps: a budget's first measurement ends early, once it timed
    first_min_steps steps over first_row_steps rows in all (a large batch's step averages over many rows, so a few
    steps measure it; a new engine's first requests then spend less time on budgets it will not hold). Budget 0
    commits exactly one token per row per step whatever the text, so its epochs need no rows: epoch_steps timed
    steps (its first, first_min_steps if fewer). start_tokens: a bucket's search starts at no budget whose verify of
    the bucket's rows holds more tokens than this (the optima measured on the H200, bench/RESULTS.md session 21:
    the full 31-node tree at batch 16, 7 at 32, 7 to 15 at 64), so a new engine's first steps at a large batch do
    not pay for the full tree."""

    epoch_steps: int = 16
    epoch_rows: int = 256
    hold_epochs: int = 8
    max_hold_epochs: int = 64
    margin: float = 0.03
    alpha: float = 0.5
    max_epoch_steps: int = 512
    first_row_steps: int = 192
    first_min_steps: int = 4
    start_tokens: int = 512


class _Epochs:
    """One (batch bucket, kind) of ``EpochBudget``: the budget held (an index into the options), the best one
    (the incumbent), the epoch under way, each budget's measured rate (tokens per row-second, None until
    measured) and whether the first search is still under way."""

    def __init__(self, n: int, start: int) -> None:
        self.rates: list[float | None] = [None] * n
        self.held = self.best = start
        self.searching = True
        self.steps = self.timed = self.row_steps = 0  # this epoch's steps, timed steps, and rows in timed steps
        self.rows = 0  # rows of the step under way
        self.tokens = self.seconds = 0.0
        self.since_probe = 0
        self.hold = 0  # epochs between probes (set by EpochBudget)
        self.probes = 0  # probes so far: which of the best's neighbours (and budget 0) the next one measures


class EpochBudget:
    """The node budget of a pipelined engine's steps: for each batch bucket and kind of step (all rows greedy, or
    some sampled), one budget held for epochs of steps, so that the step queued on the device behind each verify is
    built under the budget the next step uses (a change of budget drops it). Each budget is judged by what a user
    gets from it: tokens committed per row per wall second of whole engine steps (host work, the overlap and the
    reads included), averaged over its epochs. Per row, because a bucket's steps cost the same whatever rows of it
    are live (their graphs run the whole bucket) while the tokens they commit scale with the rows: an epoch that
    fell in a batch's tail, with fewer rows, would otherwise make its budget look slow.

    A bucket's first budgets are found by a local search: it starts at the best budget of the nearest bucket of the
    same kind already measured (the full tree when there is none), or lower where that budget's verify of the
    bucket's rows would hold more than ``EpochConfig.start_tokens`` tokens, then measures the neighbours of the best
    budget so far, below first, until the best has no unmeasured neighbour, and budget 0 (plain decoding, the floor
    every budget is judged against; one short epoch) if the search did not reach it; other budgets far from the best
    (the full tree at a large batch, small trees at batch 1) are never paid for. Then the best is held, and a
    neighbour is probed every ``hold`` epochs (above, below and budget 0 in turn; ``hold`` doubles while probes
    change nothing), so a change in acceptance or cost moves the choice. Budget 0 is probed however far the best
    is from it: its rate is the floor every budget must beat, and a search measures it once, in one short epoch
    (on a new engine, often in its slowest first steps). The held budget changes only to one measured
    ``margin`` faster (measurement noise does not flip it), and budget 0 (plain decoding) is chosen unless the best
    beats it by ``margin``, so speculating is not slower than decoding by more than the measurements err. A step
    whose budget differs from the step before it is not timed: the step queued behind the previous verify was built
    under the old budget and is dropped, so that step runs without overlap, a cost of the switch and not of either
    budget (it would weigh most on the cheapest budgets, whose steps are shortest). Same interface as
    ``BudgetController`` (``speculate``, ``observe_step``, ``timing_valid``, ``chosen``)."""

    def __init__(self, options: list[BudgetOption], config: EpochConfig | None = None) -> None:
        self.config = config or EpochConfig()
        self.options = sorted(options)
        if not self.options or self.options[0].nodes != 0:
            raise ValueError("EpochBudget needs budget 0 (plain decoding) among its options")
        self.states: dict[tuple[int, bool], _Epochs] = {}
        self.chosen: Counter = Counter()  # (rows, nodes) -> steps
        self.timing_valid = True  # False: this step ran a prefill, so its wall time is not the budget's
        self._step: tuple[_Epochs, int] | None = None  # the last speculate's state and tokens committed
        self._last_nodes: int | None = None  # the budget of the step before
        self._switched = False  # this step's budget differs from the step before's: its queued step was dropped

    def key(self, rows: list) -> tuple[int, bool]:
        """(batch bucket, whether every row is greedy): the budgets are chosen apart for each."""
        return batch_key(len(rows)), all(r.params.greedy for r in rows)

    def _new_state(self, key: tuple[int, bool]) -> _Epochs:
        """A bucket's state, its search starting at the best budget of the nearest measured bucket of its kind (the
        full tree when there is none), or lower: at no budget whose verify of the bucket's rows holds more than
        ``EpochConfig.start_tokens`` tokens (the smallest speculating budget when every one does)."""
        b, kind = key
        seen = [(abs(math.log(b / ob)), ob, s) for (ob, okind), s in self.states.items()
                if okind == kind and any(r is not None for r in s.rates)]
        start = min(seen)[2].best if seen else len(self.options) - 1
        fits = [j for j, o in enumerate(self.options) if j and (o.nodes + 1) * b <= self.config.start_tokens]
        start = min(start, fits[-1] if fits else min(1, len(self.options) - 1))
        state = _Epochs(len(self.options), start)
        state.hold = self.config.hold_epochs
        return state

    def choose(self, rows: list) -> int:
        """The node budget of a step over ``rows``: the one its bucket holds."""
        key = self.key(rows)
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = self._new_state(key)
        nodes = self.options[state.held].nodes
        state.rows = len(rows)
        self._switched, self._last_nodes = nodes != self._last_nodes, nodes
        self.chosen[(len(rows), nodes)] += 1
        self._step = (state, 0)
        return nodes

    def speculate(self, rows: list, proposer, verifier) -> list:
        """One propose -> verify step of ``rows`` under their bucket's budget (``proposer.budget``)."""
        proposer.budget = self.choose(rows)
        results = verifier.verify_proposal(rows, proposer.propose(rows))
        self._step = (self._step[0], sum(len(r.accepted_nodes) + 1 for r in results))
        return results

    def observe_step(self, seconds: float) -> None:
        """Wall seconds of the whole engine step whose rows ``speculate`` ran last."""
        step, self._step = self._step, None
        if step is None:
            return
        state, tokens = step
        state.steps += 1
        if self.timing_valid and not self._switched:
            state.timed += 1
            state.row_steps += state.rows
            state.tokens += tokens
            state.seconds += seconds
        cfg = self.config
        first = state.rates[state.held] is None  # a first measurement may end sooner
        if state.held == 0:  # plain decoding: one token per row per step, whatever the rows
            done = state.timed >= (min(cfg.first_min_steps, cfg.epoch_steps) if first else cfg.epoch_steps)
        else:
            done = state.timed >= cfg.epoch_steps and state.row_steps >= cfg.epoch_rows
            done = done or (first and state.timed >= cfg.first_min_steps and state.row_steps >= cfg.first_row_steps)
        if done or (state.steps >= cfg.max_epoch_steps and state.timed):
            self._end_epoch(state)
        elif state.steps >= cfg.max_epoch_steps:  # nothing timed: the epoch starts over
            state.steps = 0

    def _end_epoch(self, state: _Epochs) -> None:
        cfg, i = self.config, state.held
        rate = state.tokens / max(state.seconds, 1e-9) * state.timed / max(state.row_steps, 1)  # per row
        old = state.rates[i]
        state.rates[i] = rate if old is None else old + cfg.alpha * (rate - old)
        state.steps = state.timed = state.row_steps = 0
        state.tokens = state.seconds = 0.0
        if state.searching:
            nxt = self._next_to_search(state)
            if nxt is not None:
                state.held = nxt
                return
            state.searching = False
            state.best = state.held = self._best(state)  # (the search's start is the incumbent)
            return
        probing = state.held != state.best
        best = self._best(state)
        if best != state.best:  # the choice moved: probe its neighbours soon again
            state.best, state.hold = best, cfg.hold_epochs
        elif probing:  # a probe that changed nothing: probe less often
            state.hold = min(2 * state.hold, cfg.max_hold_epochs)
        if state.held != state.best:  # a probe ended (or the held budget fell behind): back to the best
            state.held, state.since_probe = state.best, 0
            return
        state.since_probe += 1
        if state.since_probe >= state.hold:  # probe a neighbour of the best, above and below, then budget 0, in turn
            turn = [j for j in (state.best + 1, state.best - 1) if 0 <= j < len(self.options)]
            turn += [0] if state.best > 1 else []  # (else 0 is a neighbour, or the best)
            if turn:
                state.held = turn[state.probes % len(turn)]
                state.probes += 1
            state.since_probe = 0

    def _next_to_search(self, state: _Epochs) -> int | None:
        """The search's next budget: an unmeasured neighbour (below first) of the fastest budget measured, then
        budget 0 if it is still unmeasured."""
        rates = state.rates
        top = max((j for j, r in enumerate(rates) if r is not None), key=rates.__getitem__)
        near = (j for j in (top - 1, top + 1) if 0 <= j < len(rates) and rates[j] is None)
        return next(near, 0 if rates[0] is None else None)

    def _best(self, state: _Epochs) -> int:
        """The budget to hold: the fastest measured, unless it is within ``margin`` of the incumbent (then the
        incumbent) or of budget 0 (then 0)."""
        rates, margin = state.rates, self.config.margin
        known = [j for j, r in enumerate(rates) if r is not None]
        pick = max(known, key=rates.__getitem__)
        if rates[state.best] is not None and rates[pick] <= rates[state.best] * (1 + margin):
            pick = state.best
        if rates[0] is not None and rates[pick] <= rates[0] * (1 + margin):
            return 0
        return pick

    def mean_budget(self, rows: int | None = None, since: Counter | None = None) -> float | None:
        """Mean chosen budget over steps of ``rows`` rows (all steps when None), after the ``since`` snapshot."""
        return mean_budget(self.chosen, rows, since)

    def measured(self) -> dict[str, dict[int, float]]:
        """Each bucket's measured rates, 'b<bucket> greedy|sampled' -> {nodes: tokens per row-second}, the
        budget held first: what the choice was made from (bench JSON records it)."""
        out = {}
        for (b, greedy), state in sorted(self.states.items()):
            rates = {self.options[j].nodes: round(r, 1) for j, r in enumerate(state.rates) if r is not None}
            held = self.options[state.held].nodes
            out[f"b{b} {'greedy' if greedy else 'sampled'}"] = {held: rates.get(held), **rates}
        return out


def make_controller(enabled: bool | None, device, drafter, graphs, epochs: bool = False,
                    ) -> BudgetController | EpochBudget | None:
    """The engine's controller, or None (adaptive off, or a drafter with nothing to draft). ``enabled``
    None is on for CUDA only: there a step's cost depends on the batch enough to matter and graph
    timings are steady; on the CPU tree shapes stay fixed by default, so acceptance statistics (never
    greedy output, which no budget changes) are reproducible run to run. ``epochs`` (a pipelined engine):
    an ``EpochBudget`` over the drafter's budgets; else a ``BudgetController``, whose verify costs start from
    the captured graphs' measured replay times."""
    want = enabled if enabled is not None else device.type == "cuda"
    if not want or drafter.max_nodes == 0:
        return None
    if epochs:
        buckets = graphs.query_buckets[0] if graphs is not None else QUERY_BUCKETS
        return EpochBudget(_undominated(budget_options(drafter), lambda n: bucket(n, buckets) or n))
    table = graphs.measure_costs() if graphs is not None and graphs.graphs else None
    buckets = graphs.query_buckets[0] if graphs is not None else QUERY_BUCKETS
    return BudgetController(budget_options(drafter), cost_table=table, query_buckets=buckets)


def _undominated(options: list[BudgetOption], query_key=query_key) -> list[BudgetOption]:
    """Options sorted by nodes, keeping the deepest of those that share a query bucket (``query_key``)
    and a draft cost (they cost the same, and a deeper tree commits at least as much)."""
    best: dict[tuple[int, int], BudgetOption] = {}
    for o in options:
        key = (query_key(o.nodes + 1), o.draft_forwards)
        if key not in best or (o.depth, o.nodes) > (best[key].depth, best[key].nodes):
            best[key] = o
    return sorted(best.values())
