"""The pipelined engine's tree budget (``EpochBudget``: one budget per batch bucket held for epochs of steps, chosen
by measured tokens per second) and the choice of an engine's budget policy (``make_controller``: that, the
per-step ``adaptive.BudgetController``, or none)."""

from __future__ import annotations

import math
import statistics
import time
from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass

from specdec.adaptive import BudgetController, BudgetOption, batch_key, budget_options, mean_budget, undominated
from specdec.graphs import QUERY_BUCKETS, bucket


def step_tokens(results, budgets: list[int]) -> list[int]:
    """Tokens a step's rows committed, and would have committed under each smaller budget: for each of ``budgets``
    (node counts, up to the step's own), its rows plus the accepted nodes that budget keeps. A proposal under a
    smaller budget is the same proposal cut to its nodes of rank below that budget (a chain's first tokens, a static
    tree's first levels, a dynamic tree's best nodes; ``VerifyResult.ranks``, else the node's index), and every
    token the verify chooses is the target's own (its argmax, or its draw with the request's keyed noise), whatever
    was proposed: so a smaller budget's path is this path up to its first node that budget does not keep, and the
    counts are exact, on the same text as the step's own."""
    ranks = sorted(x for r in results for x in (r.accepted_nodes if r.ranks is None else r.ranks))
    return [len(results) + bisect_left(ranks, n) for n in budgets]


@dataclass(frozen=True)
class EpochConfig:
    """epoch_steps, epoch_rows: an epoch (the steps a budget is held before it is judged) ends once it timed at least
    epoch_steps steps over at least epoch_rows rows in all (a small batch's tokens per step vary with the text, so its
    epochs run longer); hold_epochs: epochs the best budget is held before a neighbour is probed, doubled after each
    probe that leaves the best where it is (up to max_hold_epochs) and reset when the best moves; margin: how much more
    tokens per second a budget must measure than the one held to be held instead; plain_margin: how much more a
    speculating budget must measure than plain decoding (budget 0) to be held instead of it, in a bucket of more than
    one row (one row: margin). A speculating batch's rows end at different steps, so a continuous batch admits its next
    rows a few at a time, each admission a step in which the joining rows decode nothing, and the last rows drain alone,
    where plain decoding's rows end together and the next ones join at once; a budget's rate counts tokens per live row
    and does not see that: on the H100 the held budget's rate over plain decoding's promised 10-23% more than the runs
    gave at batch 16 and 6-14% more at batch 64 (bench/RESULTS.md, "Findings behind current defaults"), so a budget
    promising less than 15% more gained nothing or lost. window: the latest epochs of each budget kept (its step cost is
    the least of their median steps: what slows a step is never the budget's doing when another epoch of it ran faster;
    its token counts are summed); plain_reach: budget 0 is probed (once it has window epochs) only while the best
    measures less than this much more than it (a probe of plain decoding where the best is far ahead costs a whole epoch
    and moves nothing); cost_slack: a search re-measures, once, a budget whose step measured more than this much dearer
    than a larger budget's (a smaller verify costs no more: something else slowed that epoch); max_epoch_steps: steps
    after which an epoch ends however few of them were timed (steps that ran a prefill are not); first_row_steps,
    first_min_steps: the search's first epoch ends early, once it timed first_min_steps steps over first_row_steps rows
    in all (a large batch's step averages over many rows, so a few steps measure it; a new engine's first requests then
    spend less time on budgets it will not hold); a budget whose tokens a larger one's epochs already counted (every
    budget below the search's start) needs only its step cost: its first epoch is first_min_steps timed steps.
    start_tokens: a bucket's search starts at no budget whose verify of the bucket's rows holds more tokens than this
    (the measured optima were the full 31-node tree at batch 16, 7 at 32, 7 to 15 at 64: bench/RESULTS.md, "Findings
    behind current defaults"), so a new engine's first steps at a large batch do not pay for the full tree. shadow_rows,
    shadow_min_rows, shadow_kept: with a proposer whose chains cost nothing on the device (``Drafter.free_chain``:
    n-gram lookup), a bucket held at plain decoding looks up the chains of shadow_rows of its rows per step (in turn)
    and counts what each budget would have committed on them once their tokens are known (``EpochBudget.watch``); a
    speculating budget is probed only when those counts, over at least shadow_min_rows looked-up rows (halved past
    shadow_kept, so they follow the text), say it may beat plain decoding; shadow_wait: once they say a budget would be
    chosen over plain decoding in a greedy bucket, it is probed after shadow_wait epochs instead of at its turn (the
    text turned to one the chains predict: the turn can be hundreds of steps away), the wait doubling while such
    probes change nothing (a budget's kept epochs from older text weigh on its rate for a few epochs) until they stop
    saying so. free_sampled_rows: with such a proposer, a bucket of more rows than this with sampled rows holds plain
    decoding from its first step, with no search, no probe and no watch: there its chains gain 10-17% per live row
    while rows loop, less than what a probe's budget switches and the rows it leaves ending apart cost (on the H100,
    held at plain decoding 0.993-1.001x of target-only in seven of eight runs at batch 16 and 64, T=0.7 and 1.0,
    against 0.976-0.988x with the search and probes; the eighth, batch 64 at T=0.7, 0.972x against 1.020x:
    bench/RESULTS.md, session 45); None: every bucket searches."""

    epoch_steps: int = 16
    epoch_rows: int = 256
    hold_epochs: int = 8
    max_hold_epochs: int = 64
    margin: float = 0.03
    plain_margin: float = 0.15
    plain_reach: float = 0.25
    window: int = 3
    cost_slack: float = 0.05
    max_epoch_steps: int = 512
    first_row_steps: int = 192
    first_min_steps: int = 4
    start_tokens: int = 512
    shadow_rows: int = 1
    shadow_min_rows: int = 64
    shadow_kept: int = 2048
    shadow_wait: int = 1
    free_sampled_rows: int | None = 8


class _Epochs:
    """One (batch bucket, kind) of ``EpochBudget``: the budget held (an index into the options), the best one
    (the incumbent), the epoch under way, each budget's latest epochs (their median steps, and their token counts:
    rows, then tokens under each budget up to the one held) and whether the first search is still under way."""

    def __init__(self, n: int, start: int, window: int) -> None:
        self.costs = [deque(maxlen=window) for _ in range(n)]  # each budget's latest epochs' median step seconds
        self.counts = [deque(maxlen=window) for _ in range(n)]  # its latest epochs' [rows, tokens under 0..budget]
        self.held = self.best = self.start = start
        self.searching = True
        self.remeasured: set[int] = set()  # budgets the search measured again (``EpochConfig.cost_slack``)
        self.steps = self.row_steps = 0  # this epoch's steps, and rows in its timed steps
        self.rows = 0  # rows of the step under way
        self.key: tuple[int, bool] = (0, False)  # (batch bucket, all rows greedy)
        self.times: list[float] = []  # this epoch's timed steps' seconds
        self.tokens = [0] * n  # this epoch's timed steps' tokens under each budget up to the one held
        self.since_probe = 0
        self.hold = 0  # epochs between probes (set by EpochBudget)
        self.probes = 0  # probes so far: which of the best's neighbours (and budget 0) the next one measures
        self.ended = 0  # ``EpochBudget``'s count of ended epochs when this state was made (its start was derived)
        # rows looked up while held at plain decoding, and the tokens each budget would have committed on them
        self.shadow = [0] * (n + 1)
        self.eager_wait = 0  # epochs before the next probe the chains ask for (``EpochConfig.shadow_wait``)
        self.fixed = False  # held at plain decoding for good (``EpochConfig.free_sampled_rows``)

    @property
    def timed(self) -> int:
        """This epoch's timed steps."""
        return len(self.times)

    def cost(self, j: int) -> float | None:
        """Budget j's step seconds: the least median step of its latest epochs, and no more than a larger budget's
        (a larger verify costs no less); None until measured."""
        if not self.costs[j]:
            return None
        return min(min(c) for c in self.costs[j:] if c)

    def ratio(self, j: int, b: int) -> float | None:
        """Tokens budget j commits over those budget b commits, counted on the same steps: every kept epoch of a
        budget at least as large as both; None when none is."""
        num = den = 0
        for h in range(max(j, b), len(self.counts)):
            for c in self.counts[h]:
                num, den = num + c[1 + j], den + c[1 + b]
        return num / den if den else None

    def rates(self) -> list[float | None]:
        """Each budget's tokens per row-second on the text of the best's latest epochs: its tokens relative to the
        best's on the same steps, the best's tokens per row there, over its own step cost (None until both are
        known)."""
        b = self.best
        per_row = self.ratio(b, 0)  # the best's tokens per row (budget 0's tokens are the rows)
        out: list[float | None] = []
        for j in range(len(self.costs)):
            r, c = self.ratio(j, b), self.cost(j)
            out.append(None if r is None or c is None or not per_row else r * per_row / c)
        return out


class EpochBudget:
    """The node budget of a pipelined engine's steps: for each batch bucket and kind of step (all rows greedy, or some
    sampled), one budget held for epochs of steps, so that the step queued on the device behind each verify is built
    under the budget the next step uses (a change of budget drops it). Each budget is judged by what a user gets
    from it: tokens committed per row per wall second of whole engine steps (host work, the overlap and the reads
    included). The two parts are measured apart. Its step cost: an epoch's median step (steps that cost more for
    reasons of no budget, such as the first after rows joined, the garbage collector or another process, are left
    out), the least of its latest ``EpochConfig.window`` epochs'. Its tokens: counted on the same steps as every
    budget it is compared with (``step_tokens``: a step under budget h also says what each budget below h would have
    committed), so the text, whose acceptance moves the tokens per row by 20% from one epoch to the next, cancels
    out of every comparison; a budget above the one held is compared through its own epochs, which count the held
    one's tokens too. Per row, because a bucket's steps cost the same whatever rows of it are live (their graphs run
    the whole bucket) while the tokens they commit scale with the rows.

    A bucket's search starts at the best budget of the nearest bucket of the same kind already measured (one option
    larger per halving of the batch when that bucket is larger; the full tree when there is none), or lower where
    that budget's verify of the bucket's rows would hold more than ``EpochConfig.start_tokens`` tokens; a bucket that
    has not timed a step yet derives its start again once epochs of other buckets have ended since (the buckets a
    new engine's first steps pass through, as its batch fills, are made before any is measured). Its first
    epoch counts the tokens of every budget below it, so each of those needs only a short epoch for its step cost
    (down to budget 0, plain decoding, the floor every budget is judged against); a budget measured dearer than a
    larger one is measured once more; then the budgets above the start, while the largest measured is the best.
    Then the best is held, and a neighbour is probed every ``hold`` epochs (budget 0, above and below in turn; held at
    budget 0, every speculating budget in turn, and with free chains only those they say may pay, the one they say would
    be chosen sooner; ``hold`` doubles while probes change nothing), so a change in acceptance or cost moves the choice.
    Budget 0 is probed, first, until it has ``window`` epochs, then only while it is in reach of the best
    (``plain_reach``). The held budget changes only to one measured ``margin`` faster (measurement noise does not flip
    it), and budget 0 (plain decoding) is chosen unless the best beats it by ``plain_margin`` (what a speculating
    batch's uneven ends cost, which per-row rates do not see), so speculating is not slower than decoding by more than
    the measurements err. A step whose budget differs from the step before it is not timed: the step queued behind the
    previous verify was built under the old budget and is dropped, so that step runs without overlap, a cost of the
    switch and not of either budget (it would weigh most on the cheapest budgets, whose steps are shortest). Same
    interface as ``BudgetController`` (``speculate``, ``observe_step``, ``timing_valid``, ``chosen``)."""

    def __init__(self, options: list[BudgetOption], config: EpochConfig | None = None, agree=None,
                 shadow=None) -> None:
        self.config = config or EpochConfig()
        # ``shadow(req, k)``: the chain of at most k tokens the proposer would give ``req`` now, looked up on the host
        # at no device cost (``Drafter.free_chain``), or None: probes are gated by what those chains would commit
        self.shadow = shadow
        self._watched: deque = deque(maxlen=1024)  # (state, request, its length, chain) not yet resolved
        self._turn = 0  # the next row ``watch`` looks up
        # under tensor parallelism: each ended epoch's decisions become rank 0's (``parallel.from_rank0``); every
        # rank ends its epochs at the same steps (they count steps, not seconds), but chooses from its own timings
        self.agree = agree
        self.options = sorted(options)
        if not self.options or self.options[0].nodes != 0:
            raise ValueError("EpochBudget needs budget 0 (plain decoding) among its options")
        self._nodes = [o.nodes for o in self.options]
        self.states: dict[tuple[int, bool], _Epochs] = {}
        self.chosen: Counter = Counter()  # (rows, nodes) -> steps
        self.timing_valid = True  # False: this step ran a prefill, so its wall time is not the budget's
        self._step: tuple[_Epochs, list[int]] | None = None  # the last speculate's state and ``step_tokens``
        self._last_nodes: int | None = None  # the budget of the step before
        self._last_key: tuple[int, bool] | None = None  # the bucket and kind of the step before
        self._switched = False  # this step's budget differs from the step before's: its queued step was dropped
        self.epochs: deque = deque(maxlen=4096)  # the latest ended epochs (``epoch_log``)
        self._ended = 0  # epochs ended so far, in every bucket

    def key(self, rows: list) -> tuple[int, bool]:
        """(batch bucket, whether every row is greedy): the budgets are chosen apart for each."""
        return batch_key(len(rows)), all(r.params.greedy for r in rows)

    def _new_state(self, key: tuple[int, bool]) -> _Epochs:
        """A bucket's state, its search starting from the best budget of the nearest measured bucket of its kind (the
        full tree when there is none), one option larger for each halving of the batch when that bucket is larger (a
        batch's best budget grows as its rows fall, and the options about double: a smaller bucket is most often a
        batch's tail, whose few steps rarely finish a search, so its last rows run larger trees from the start), or
        lower: at no budget whose verify of the bucket's rows holds more than ``EpochConfig.start_tokens`` tokens
        (the smallest speculating budget when every one does)."""
        b, kind = key
        seen = [(abs(math.log(b / ob)), ob, s) for (ob, okind), s in self.states.items()
                if okind == kind and any(s.costs)]
        start = len(self.options) - 1
        if seen:
            _, near, nearest = min(seen)
            start = min(start, nearest.best + max(0, round(math.log2(near / b))))
        fits = [j for j, o in enumerate(self.options) if j and (o.nodes + 1) * b <= self.config.start_tokens]
        start = min(start, fits[-1] if fits else min(1, len(self.options) - 1))
        state = _Epochs(len(self.options), start, self.config.window)
        state.key, state.ended = key, self._ended
        state.hold, state.eager_wait = self.config.hold_epochs, self.config.shadow_wait
        most = self.config.free_sampled_rows
        if self.shadow is not None and not kind and most is not None and b > most:
            state.fixed, state.searching, state.held, state.best, state.hold = True, False, 0, 0, 1 << 62
        return state

    def choose(self, rows: list) -> int:
        """The node budget of a step over ``rows``: the one its bucket holds. A step that runs a prefill
        (``timing_valid`` False) over fewer rows than the step before, of the same kind, is a step of that step's
        bucket: its batch is short only while the prompts of the rows that join it are prefilled (a wave of rows that
        ended together), and a budget of its own small bucket would drop the step queued under the batch's budget, then
        switch back (and drop again) at the next step, when the joining rows decode."""
        key, last = self.key(rows), self._last_key
        if not self.timing_valid and last is not None and last[1] == key[1] and last[0] > key[0]:
            key = last
        self._last_key = key
        state = self.states.get(key)
        if state is None or (state.ended < self._ended and not state.timed and not any(state.costs)):
            state = self.states[key] = self._new_state(key)  # (a state never measured: its start from those since)
        nodes = self._nodes[state.held]
        state.rows = len(rows)
        self._switched, self._last_nodes = nodes != self._last_nodes, nodes
        self.chosen[(len(rows), nodes)] += 1
        self._step = (state, [])
        return nodes

    def speculate(self, rows: list, proposer, verifier) -> list:
        """One propose -> verify step of ``rows`` under their bucket's budget (``proposer.budget``)."""
        proposer.budget = self.choose(rows)
        state = self._step[0]
        if state.fixed:  # (held at plain decoding for good: nothing to watch, count or time)
            self._step = None
            return verifier.verify_proposal(rows, proposer.propose(rows))
        self.watch(rows)
        results = verifier.verify_proposal(rows, proposer.propose(rows))
        # (plain decoding commits one token per row: nothing to count)
        self._step = (state, step_tokens(results, self._nodes[:state.held + 1]) if state.held else [len(results)])
        return results

    def watch(self, rows: list) -> None:
        """With a ``shadow`` proposer, in a bucket held at plain decoding after its search: look up the chains of
        ``EpochConfig.shadow_rows`` of ``rows`` (in turn), and count the chains looked up earlier whose rows' tokens
        are now known. Each token a row commits is the target's own choice at its position (its argmax, or its draw
        under the request's keyed noise) whatever was proposed, so a chain proposed at a row's length L would have
        had accepted exactly its longest prefix equal to the tokens the row committed from L on: a budget of n
        commits 1 + min(that prefix, n) tokens there."""
        state = self._step[0] if self._step is not None else None
        if self.shadow is None or state is None:
            return
        cfg, longest = self.config, self._nodes[-1]
        if state.held == 0 and not state.searching and not state.fixed and rows:
            for _ in range(min(cfg.shadow_rows, len(rows))):
                req = rows[self._turn % len(rows)]
                self._turn += 1
                self._watched.append((state, req, len(req.tokens), self.shadow(req, longest)))
        while self._watched:
            st, req, length, chain = self._watched[0]
            known = req.tokens[length:length + len(chain)]
            if len(known) < len(chain) and not req.finished:
                break  # (rows move together: the later ones are not known yet either)
            self._watched.popleft()
            accepted = next((i for i, (a, b) in enumerate(zip(chain, known)) if a != b), min(len(chain), len(known)))
            counts = st.shadow
            counts[0] += 1
            for j, n in enumerate(self._nodes):
                counts[1 + j] += 1 + min(accepted, n)
            if counts[0] > cfg.shadow_kept:
                st.shadow = [c / 2 for c in counts]

    def _shadow_gain(self, state: _Epochs, j: int) -> float | None:
        """Budget j's rate over plain decoding's in a bucket held at plain decoding, as its looked-up chains
        (``watch``) count it: the tokens per row they would commit, over budget j's step cost relative to plain
        decoding's when both are measured (else plain's: a larger verify costs no less); None until enough rows were
        looked up."""
        rows, cfg = state.shadow[0], self.config
        if self.shadow is None or rows < cfg.shadow_min_rows:
            return None
        gain = state.shadow[1 + j] / rows
        c0, cj = state.cost(0), state.cost(j)
        return gain * c0 / cj if c0 and cj else gain

    def _plain_bar(self, state: _Epochs) -> float:
        """How much more than plain decoding a budget must measure to be held instead (``_best``)."""
        return 1 + (self.config.plain_margin if state.key[0] > 1 else self.config.margin)

    def _may_pay(self, state: _Epochs, j: int) -> bool:
        """Whether a probe of speculating budget j could move a bucket held at plain decoding: its looked-up chains
        say it comes within ``margin`` of what ``_best`` asks of it (True until enough rows were looked up)."""
        gain, cfg = self._shadow_gain(state, j), self.config
        return gain is None or gain > self._plain_bar(state) - cfg.margin

    def _would_be_chosen(self, state: _Epochs) -> int | None:
        """A greedy bucket held at plain decoding: the speculating budget whose looked-up chains say it beats plain
        decoding by more than ``_best`` asks (and ``margin``), the fastest such, or None. (With sampled rows such
        counts come from a few rows whose samples loop for a while, and on the H100 those probes held chains that
        lost: bench/RESULTS.md, "Findings behind current defaults".)"""
        if state.best != 0 or not state.key[1]:
            return None
        bar = self._plain_bar(state) + self.config.margin
        gains = [(g, j) for j in range(1, len(self.options)) if (g := self._shadow_gain(state, j)) and g > bar]
        return max(gains)[1] if gains else None

    def observe_step(self, seconds: float) -> None:
        """Wall seconds of the whole engine step whose rows ``speculate`` ran last."""
        step, self._step = self._step, None
        if step is None:
            return
        state, tokens = step
        state.steps += 1
        if self.timing_valid and not self._switched and tokens:
            state.row_steps += state.rows
            state.times.append(seconds)
            for j, t in enumerate(tokens):
                state.tokens[j] += t
        cfg = self.config
        h = state.held
        if h == 0 or (state.searching and any(state.counts[h + 1:])):  # its tokens are known: its cost is measured
            short = state.searching or not state.costs[h]  # (budget 0 commits one token per row per step)
            done = state.timed >= (min(cfg.first_min_steps, cfg.epoch_steps) if short else cfg.epoch_steps)
        else:
            done = state.timed >= cfg.epoch_steps and state.row_steps >= cfg.epoch_rows
            done = done or (not state.costs[h] and state.timed >= cfg.first_min_steps
                            and state.row_steps >= cfg.first_row_steps)
        if done or (state.steps >= cfg.max_epoch_steps and state.timed):
            self._end_epoch(state)
            if self.agree is not None:
                decided = [state.held, state.best, state.hold, int(state.searching), state.since_probe, state.probes]
                state.held, state.best, state.hold, searching, state.since_probe, state.probes = self.agree(decided)
                state.searching = bool(searching)
        elif state.steps >= cfg.max_epoch_steps:  # nothing timed: the epoch starts over
            state.steps = 0

    def _end_epoch(self, state: _Epochs) -> None:
        cfg, h = self.config, state.held
        self._ended += 1
        state.costs[h].append(statistics.median(state.times))
        state.counts[h].append([state.row_steps, *state.tokens[:h + 1]])
        self._log_epoch(state)
        state.steps = state.row_steps = 0
        state.times = []
        state.tokens = [0] * len(self.options)
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
            state.best, state.hold, state.eager_wait = best, cfg.hold_epochs, cfg.shadow_wait
        elif probing:  # a probe that changed nothing: probe less often
            state.hold = min(2 * state.hold, cfg.max_hold_epochs)
        if state.held != state.best:  # a probe ended (or the held budget fell behind): back to the best
            state.held, state.since_probe = state.best, 0
            return
        state.since_probe += 1
        eager = self._would_be_chosen(state)
        if eager is None:
            state.eager_wait = cfg.shadow_wait
        elif state.since_probe >= state.eager_wait:
            state.held, state.since_probe, state.eager_wait = eager, 0, 2 * state.eager_wait
            state.probes += 1
            return
        if state.since_probe >= state.hold:  # probe budget 0, then the best's neighbours above and below, in turn
            turn = [0] if state.best > 1 and self._plain_in_reach(state) else []  # (else a neighbour, or the best)
            turn += [j for j in (state.best + 1, state.best - 1) if 0 <= j < len(self.options)]
            # (held at plain decoding, every larger budget in turn too: budget 0's one neighbour is the smallest
            # budget, often the least gain, so a plain choice made from a search's slow first steps would otherwise
            # never measure the larger ones again)
            turn += list(range(2, len(self.options))) if state.best == 0 else []
            if state.best == 0:  # (a proposer whose chains are free: only the budgets they say may pay)
                turn = [j for j in turn if self._may_pay(state, j)]
            if turn:
                state.held = turn[state.probes % len(turn)]
                state.probes += 1
            state.since_probe = 0

    def _plain_in_reach(self, state: _Epochs) -> bool:
        """Whether a probe of budget 0 could move the choice: it has fewer than ``window`` epochs, or the best
        measures less than ``plain_reach`` more than it. Budget 0 commits one token per row per step whatever the
        text, and its tokens are counted on the best's own steps, so what would bring it back in reach is a change in
        the step costs, which its probes measure."""
        rates = state.rates()
        return (len(state.costs[0]) < self.config.window or rates[state.best] is None or rates[0] is None
                or rates[state.best] <= rates[0] * (1 + self.config.plain_reach))

    def _log_epoch(self, state: _Epochs) -> None:
        h = state.held
        median = state.costs[h][-1]
        self.epochs.append({
            "t": time.perf_counter(), "bucket": state.key[0], "greedy": state.key[1], "nodes": self._nodes[h],
            "phase": "search" if state.searching else "hold" if h == state.best else "probe",
            "steps": state.steps, "timed": state.timed, "row_steps": state.row_steps, "tokens": state.tokens[h],
            "seconds": sum(state.times), "rate": state.tokens[h] / max(state.row_steps, 1) / max(median, 1e-9),
            "median_step_s": median, "max_step_s": max(state.times), "best_before": self._nodes[state.best],
            "shadow_gains": {self._nodes[j]: None if (g := self._shadow_gain(state, j)) is None else round(g, 4)
                             for j in range(1, len(self.options))}})

    def epoch_log(self) -> list[dict]:
        """The latest ended epochs, oldest first: when (perf_counter seconds), the bucket and kind, the budget held,
        why (the first ``search``, ``hold`` of the best, or a ``probe``), its steps and timed steps, rows and tokens
        in the timed ones, their seconds, its rate (tokens per row over its median step), its timed steps' median
        and longest seconds, the best budget when it ended, and each speculating budget's rate over plain decoding's
        as the watch's counts then said (by node budget; ``_shadow_gain``, None without them). What the choice was
        made from, step by step (bench JSON records it)."""
        return list(self.epochs)

    def _next_to_search(self, state: _Epochs) -> int | None:
        """The search's next budget: the largest one below the start not measured yet, else one measured dearer
        than a larger budget by more than ``cost_slack`` (once each), else the one above the largest measured while
        that is the best; None when the search is done."""
        costs = [min(c) if c else None for c in state.costs]
        below = [j for j in range(state.start, -1, -1) if costs[j] is None]
        if below:
            return below[0]
        slack = 1 + self.config.cost_slack
        for j, c in enumerate(costs):
            larger = [k for k in costs[j + 1:] if k is not None]
            if c is not None and j not in state.remeasured and larger and c > min(larger) * slack:
                state.remeasured.add(j)
                return j
        top = max(j for j, c in enumerate(costs) if c is not None)
        if top + 1 < len(self.options):
            rates = state.rates()
            known = [j for j, r in enumerate(rates) if r is not None]
            if known and max(known, key=rates.__getitem__) == top:
                return top + 1
        return None

    def _best(self, state: _Epochs) -> int:
        """The budget to hold: the fastest measured, unless it is within ``margin`` of the incumbent (then the
        incumbent) or within ``plain_margin`` of budget 0 (then 0; ``margin`` in a bucket of one row)."""
        rates, cfg = state.rates(), self.config
        known = [j for j, r in enumerate(rates) if r is not None]
        if not known:
            return state.best
        pick = max(known, key=rates.__getitem__)
        if rates[state.best] is not None and rates[pick] <= rates[state.best] * (1 + cfg.margin):
            pick = state.best
        plain = cfg.plain_margin if state.key[0] > 1 else cfg.margin
        if rates[0] is not None and rates[pick] <= rates[0] * (1 + plain):
            return 0
        return pick

    def mean_budget(self, rows: int | None = None, since: Counter | None = None) -> float | None:
        """Mean chosen budget over steps of ``rows`` rows (all steps when None), after the ``since`` snapshot."""
        return mean_budget(self.chosen, rows, since)

    def measured(self) -> dict[str, dict[int, float]]:
        """Each bucket's rates (``_Epochs.rates``), 'b<bucket> greedy|sampled' -> {nodes: tokens per row-second},
        the budget held first: what the choice was made from (bench JSON records it)."""
        out = {}
        for (b, greedy), state in sorted(self.states.items()):
            rates = {self._nodes[j]: round(r, 1) for j, r in enumerate(state.rates()) if r is not None}
            held = self._nodes[state.held]
            out[f"b{b} {'greedy' if greedy else 'sampled'}"] = {held: rates.get(held), **rates}
        return out


def make_controller(enabled: bool, drafter, graphs, epochs: bool = False,
                    agree=None) -> BudgetController | EpochBudget | None:
    """The engine's controller (``EnginePlan.adaptive``, resolved by ``specdec.plan``), or None (off, or a drafter
    with nothing to draft). ``epochs`` (``EnginePlan.budget_epochs``, a pipelined engine): an ``EpochBudget`` over
    the drafter's budgets (``agree``: its, under tensor parallelism); else a ``BudgetController``, whose verify costs
    start from the captured graphs' measured replay times."""
    if not enabled or drafter.max_nodes == 0:
        return None
    buckets = graphs.query_buckets[0] if graphs is not None else QUERY_BUCKETS
    if epochs:
        return EpochBudget(undominated(budget_options(drafter), lambda n: bucket(n, buckets) or n), agree=agree,
                           shadow=drafter.free_chain if drafter.free_chains else None)
    table = graphs.measure_costs() if graphs is not None and graphs.graphs else None
    return BudgetController(budget_options(drafter), cost_table=table, query_buckets=buckets)
