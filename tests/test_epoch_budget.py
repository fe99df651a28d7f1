"""The pipelined engine's budget policy (``budget_policy.EpochBudget``) on made-up steps, without a model.

Each test drives ``choose`` / ``observe_step`` the way ``SpecEngine.step`` does, through a stand-in of
``speculate``'s bookkeeping: a step under budget h commits tok(n) tokens per row under each budget n <= h (what
``step_tokens`` counts on a real step's accepted paths) and costs cost(h) seconds, both chosen here; the tests check
which budget each (batch bucket, kind) holds.
"""

from __future__ import annotations

from itertools import groupby
from types import SimpleNamespace

import pytest

from specdec.adaptive import BudgetOption
from specdec.budget_policy import EpochBudget, EpochConfig, step_tokens

OPTIONS = [BudgetOption(n, d, 1) for n, d in ((0, 0), (3, 2), (7, 3), (15, 4))]
NODES = [o.nodes for o in OPTIONS]


def rows_of(n: int, greedy: bool = True) -> list:
    return [SimpleNamespace(params=SimpleNamespace(greedy=greedy if i == 0 else True)) for i in range(n)]


def step(ctrl: EpochBudget, rows: list, tok, cost, valid: bool = True, extra: float = 0.0) -> int:
    """One engine step: the budget held for ``rows``; ``tok(n)`` tokens per row under each budget n up to it,
    ``cost(held)`` (+ ``extra``) seconds."""
    nodes = ctrl.choose(rows)
    state = ctrl._step[0]
    ctrl._step = (state, [len(rows) * tok(n) for n in NODES[:state.held + 1]])
    ctrl.timing_valid = valid
    ctrl.observe_step(cost(nodes) + extra)
    return nodes


def run(ctrl, rows, tok, cost, steps) -> list[int]:
    return [step(ctrl, rows, tok, cost) for _ in range(steps)]


def model(tok: dict, ms: dict):
    """(tok, cost) callables of per-row tokens and milliseconds per step."""
    return tok.__getitem__, lambda n: ms[n] * 1e-3


def held(ctrl: EpochBudget, rows: list) -> int:
    """The budget the bucket of ``rows`` holds, without taking a step."""
    return ctrl.options[ctrl.states[ctrl.key(rows)].held].nodes


def state_of(ctrl: EpochBudget, rows: list):
    return ctrl.states[ctrl.key(rows)]


def runs(seq: list[int]) -> list[tuple[int, int]]:
    """(budget, consecutive steps) of a sequence of budgets."""
    return [(n, len(list(g))) for n, g in groupby(seq)]


def short(**kw) -> EpochConfig:
    """Epochs of a few steps whatever the batch."""
    return EpochConfig(**{"epoch_rows": 0, "first_row_steps": 0, **kw})


# rates (tokens per row-millisecond): 0 1.0, 3 1.23, 7 1.33, 15 1.1 -> 7 is the best
TOK = {0: 1.0, 3: 1.6, 7: 2.0, 15: 2.2}
MS = {0: 1.0, 3: 1.3, 7: 1.5, 15: 2.0}


def test_step_tokens_counts_what_each_smaller_budget_would_have_committed():
    """A dynamic tree's accepted path by its nodes' score ranks, a chain's by its node indices: under a budget of n
    a row commits its accepted nodes of rank below n (a prefix of its path) and its bonus token."""
    results = [SimpleNamespace(accepted_nodes=[0, 4, 9], ranks=[0, 2, 5]),  # (indices in level order, ranks)
               SimpleNamespace(accepted_nodes=[0, 1], ranks=None),  # a chain
               SimpleNamespace(accepted_nodes=[], ranks=[])]
    assert step_tokens(results, [0, 1, 3, 7]) == [3, 3 + 2, 3 + 4, 3 + 5]
    assert step_tokens(results[2:], [0, 15]) == [1, 1]


def test_the_search_counts_every_smaller_budget_on_the_starts_steps_and_measures_their_costs_briefly():
    """The full tree's first epoch (4 timed steps after the untimed switch) counts the tokens of 7, 3 and 0 too, so
    each of those runs only a short epoch for its step cost (4 timed steps), down to 0; 7 is held."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=8, hold_epochs=100))
    seq = run(ctrl, rows_of(16), *model(TOK, MS), 20 + 30)
    assert seq[:20] == [15] * 5 + [7] * 5 + [3] * 5 + [0] * 5
    assert set(seq[20:]) == {7}
    state = state_of(ctrl, rows_of(16))
    assert state.ratio(1, 3) == pytest.approx(1.6 / 2.2)  # 3 against 15, counted on 15's steps
    report = ctrl.measured()["b16 greedy"]  # what bench JSON records: the held budget first, then each measured
    assert list(report) == [7, 0, 3, 15]
    assert report[7] == pytest.approx(2000.0 / 1.5, abs=0.1) and report[3] == pytest.approx(1600.0 / 1.3, abs=0.1)


def test_the_text_moves_every_budget_alike_and_the_choice_stays():
    """The tokens per row swing by +-30% from one stretch of steps to the next (the text), for every budget at once:
    budgets compared on the same steps keep their order, so the best (7) is held through every probe. Budget 15's
    probes fall in high and low stretches alike."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=8, hold_epochs=2, max_hold_epochs=2))
    phase = [1.0]

    def tok(n):
        return TOK[n] * phase[0]

    seq = []
    for i in range(600):
        phase[0] = 1.3 if (i // 11) % 2 else 0.7
        seq.append(step(ctrl, rows_of(16), tok, lambda n: MS[n] * 1e-3))
    probes = [n for n, _ in runs(seq[20:]) if n != 7]
    assert len(probes) > 10 and set(probes) <= {0, 3, 15}
    assert ctrl.options[state_of(ctrl, rows_of(16)).best].nodes == 7


def test_a_search_epoch_slowed_by_something_else_is_measured_again():
    """Budget 3's first epoch runs at three times its cost (another process, the first use of a shape): it measures
    dearer than the larger 7, which no smaller verify does, so the search measures it once more and holds it (its
    own rate is the best: 1.7 tokens per 1.2 ms)."""
    tok = {0: 1.0, 3: 1.7, 7: 2.0, 15: 2.2}
    ms = {0: 1.0, 3: 1.2, 7: 1.6, 15: 2.2}
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=8, hold_epochs=100))
    slowed = [0]

    def cost(n):
        if n == 3 and slowed[0] < 5:
            slowed[0] += 1
            return 3 * ms[n] * 1e-3
        return ms[n] * 1e-3

    seq = run(ctrl, rows_of(16), tok.__getitem__, cost, 25 + 20)
    assert runs(seq[:25]) == [(15, 5), (7, 5), (3, 5), (0, 5), (3, 5)]
    assert set(seq[25:]) == {3}


def test_a_steps_cost_is_the_least_of_its_latest_epochs():
    """Two epochs of the held budget slowed by half again (what no budget causes) move nothing: its cost is the
    least of its latest three epochs' median steps; plain decoding's tokens are counted on the held budget's own
    steps, so they cannot look better for a slow stretch of it."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=100))
    tok, cost = model(TOK, MS)
    run(ctrl, rows_of(16), tok, cost, 20 + 12)
    assert held(ctrl, rows_of(16)) == 7
    seq = [step(ctrl, rows_of(16), tok, cost, extra=0.8e-3) for _ in range(8)]
    assert set(seq) == {7} and held(ctrl, rows_of(16)) == 7
    assert state_of(ctrl, rows_of(16)).cost(2) == pytest.approx(1.5e-3)


def test_a_budgets_tokens_are_judged_per_row():
    """Bucket 64: budget 7 is held with all 64 rows live, then the batch drains to 33 rows; per row 3 commits more
    per second than 7 throughout, so it is chosen, whatever the rows."""
    tok = {0: 1.0, 3: 1.8, 7: 2.0, 15: 2.1}
    ms = {0: 1.0, 3: 1.2, 7: 1.5, 15: 2.2}
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=100, start_tokens=1 << 20))
    seq = []
    for i in range(20 + 20):
        live = 64 if i < 10 else 33
        seq.append(step(ctrl, rows_of(live), tok.__getitem__, lambda n: ms[n] * 1e-3))
    assert set(seq[20:]) == {3}


def test_plain_decoding_unless_a_budget_beats_it_by_the_plain_margin():
    for rate3, want in ((1.04, 0), (1.06, 3)):
        ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, plain_margin=0.05))
        tok = {0: 1.0, 3: 1.3 * rate3, 7: 1.4, 15: 1.5}
        ms = {0: 1.0, 3: 1.3, 7: 1.5, 15: 2.0}
        seq = run(ctrl, rows_of(64), *model(tok, ms), 12 + 20)
        assert set(seq[12:]) == {want}, rate3


def test_the_plain_margin_is_for_batches():
    """A budget measuring 12% more tokens per row-second than plain decoding: held at one row, where nothing waits
    for it; not in a batch, where its rows' uneven ends cost a continuous batch what its per-row rate does not see
    (the default plain_margin, 15%)."""
    tok = {0: 1.0, 3: 1.12 * 1.3, 7: 1.3, 15: 1.4}
    ms = {0: 1.0, 3: 1.3, 7: 1.5, 15: 2.0}
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, start_tokens=1 << 20))
    run(ctrl, rows_of(1), tok.__getitem__, lambda n: ms[n] * 1e-3, 20)
    run(ctrl, rows_of(16), tok.__getitem__, lambda n: ms[n] * 1e-3, 20)
    assert held(ctrl, rows_of(1)) == 3 and held(ctrl, rows_of(16)) == 0


def test_the_incumbent_is_kept_unless_beaten_by_the_margin():
    """Batch 1, where the full tree (the search's start) and 7 cost about the same: 7 measuring 2% faster does not
    move the choice; 8% faster does."""
    for faster, want in ((1.02, 15), (1.08, 7)):
        ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, margin=0.05))
        tok = {0: 1.0, 3: 1.5, 7: 2.0, 15: 2.1}
        ms = {0: 1.0, 3: 1.0, 7: 1.05, 15: 1.1025 * faster}  # 7's rate over 15's: ``faster``
        seq = run(ctrl, rows_of(1), *model(tok, ms), 12 + 20)
        assert seq[:12] == [15] * 3 + [7] * 3 + [3] * 3 + [0] * 3 and set(seq[12:]) == {want}


def test_a_new_bucket_starts_from_the_nearest_measured_bucket_of_its_kind():
    """Bucket 16 settles on 3; bucket 32 then starts at 3, measures 0 below it, and 7 above (3 the best so far):
    the full tree, slow at large batches, is never run there. Smaller buckets (a batch's tail) start one option
    larger per halving of the batch: 8 at 7, 2 at 15 (the full tree). Sampled steps start their own search from
    the full tree."""
    tok = {0: 1.0, 3: 1.8, 7: 2.0, 15: 2.1}
    ms = {0: 1.0, 3: 1.2, 7: 1.5, 15: 2.2}
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, start_tokens=1 << 20))
    tok_f, cost = tok.__getitem__, lambda n: ms[n] * 1e-3
    run(ctrl, rows_of(16), tok_f, cost, 12)
    assert held(ctrl, rows_of(16)) == 3
    seq = run(ctrl, rows_of(32), tok_f, cost, 9 + 10)
    assert seq[:9] == [3] * 3 + [0] * 3 + [7] * 3 and set(seq[9:]) == {3}
    assert run(ctrl, rows_of(8), tok_f, cost, 2) == [7, 7]
    assert run(ctrl, rows_of(2), tok_f, cost, 2) == [15, 15]
    assert run(ctrl, rows_of(32, greedy=False), tok_f, cost, 2) == [15, 15]


def test_a_bucket_not_measured_yet_starts_from_buckets_measured_since_it_was_made():
    """A new engine's batch fills through small buckets in prefill steps (untimed) before any bucket is measured:
    bucket 8 is made then, at the full tree. Once bucket 16 has settled on plain decoding, bucket 8 (a batch's tail,
    not measured yet) starts one option above it, not at the full tree; a bucket that has timed steps keeps its
    search."""
    tok = {0: 1.0, 3: 1.05, 7: 1.1, 15: 1.1}  # plain decoding is the best
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=100))
    tok_f, cost = model(tok, MS)
    assert step(ctrl, rows_of(8), tok_f, cost, valid=False) == 15  # (made before anything was measured)
    ctrl.timing_valid = True
    run(ctrl, rows_of(16), tok_f, cost, 40)
    assert held(ctrl, rows_of(16)) == 0
    assert run(ctrl, rows_of(8), tok_f, cost, 2) == [3, 3]
    state = state_of(ctrl, rows_of(8))
    run(ctrl, rows_of(16), tok_f, cost, 8)
    assert run(ctrl, rows_of(8), tok_f, cost, 1) == [3] and state_of(ctrl, rows_of(8)) is state


def test_a_search_starts_no_higher_than_its_verify_token_cap():
    """With no bucket measured and the default cap (512 tokens), batches 16 and 32 start at 15 (32 x 16 tokens) and
    64 at 7 (64 x 8); the search from 7 counts 3 and 0 on its steps, measures their costs, then 15 above (7 the best
    so far); a bucket past every cap starts at the smallest speculating budget."""
    tok = {0: 1.0, 3: 1.5, 7: 2.0, 15: 2.9}
    ms = {0: 1.0, 3: 1.3, 7: 1.5, 15: 2.0}
    tok_f, cost = tok.__getitem__, lambda n: ms[n] * 1e-3
    for rows, start in ((16, 15), (17, 15), (33, 7)):
        ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100))
        assert step(ctrl, rows_of(rows), tok_f, cost) == start, rows
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100))
    seq = run(ctrl, rows_of(64), tok_f, cost, 12 + 6)
    assert seq[:12] == [7] * 3 + [3] * 3 + [0] * 3 + [15] * 3 and set(seq[12:]) == {15}
    tiny_cap = EpochBudget(OPTIONS, short(epoch_steps=2, start_tokens=8))
    assert step(tiny_cap, rows_of(64), tok_f, cost) == 3


def test_neighbours_are_probed_and_a_drift_moves_the_choice():
    """Held 7 with its neighbours 3 and 15 (and 0) probed in turn; when the larger trees' acceptance rises (the text
    changed), a probe of 15 finds it and 15 is held."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=3, max_hold_epochs=6))
    tok = dict(TOK)
    seq = run(ctrl, rows_of(8), tok.__getitem__, lambda n: MS[n] * 1e-3, 12 + 80)
    assert 15 in seq[12:] and 3 in seq[12:] and seq[12:].count(7) > 0.6 * 80
    tok[15] = 3.5  # 1.75 tokens per row-ms against 7's 1.33
    seq = run(ctrl, rows_of(8), tok.__getitem__, lambda n: MS[n] * 1e-3, 80)
    assert ctrl.options[state_of(ctrl, rows_of(8)).best].nodes == 15 and seq[-20:].count(15) > 10


def test_probes_that_change_nothing_come_less_often():
    """Epochs of one timed step; each run of a budget starts with an untimed step (the switch)."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=1, first_min_steps=1, hold_epochs=2, max_hold_epochs=8))
    seq = run(ctrl, rows_of(8), *model(TOK, MS), 8 + 60)
    assert runs(seq[:8]) == [(15, 2), (7, 2), (3, 2), (0, 2)]
    held_runs = runs(seq[8:])
    assert all(n != 7 and k == 2 for n, k in held_runs[1::2])  # the probes: one epoch each
    assert [k - 1 for n, k in held_runs[0:-1:2]][:4] == [2, 4, 8, 8]  # held 2 epochs, then 4, then at most 8


def test_plain_decoding_is_probed_until_measured_then_while_in_reach():
    """Budget 0 is measured once by the search, then probed (first, then above and below in turn) although it is
    no neighbour of the held budget (7), until it has ``window`` epochs; with the best twice as fast it is then left
    alone (a probe would cost an epoch and move nothing)."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=2, max_hold_epochs=4))
    tok = {0: 1.0, 3: 1.2, 7: 3.0, 15: 3.1}
    seq = run(ctrl, rows_of(8), tok.__getitem__, lambda n: MS[n] * 1e-3, 12 + 200)
    probes = [n for n, _ in runs(seq[12:]) if n != 7]
    assert probes[:3] == [0, 15, 3] and probes.count(0) == 2  # 3 epochs of 0 in all, with the search's
    state = state_of(ctrl, rows_of(8))
    assert len(state.costs[0]) == 3 and ctrl.options[state.best].nodes == 7


def test_steps_with_a_prefill_are_not_timed_and_an_untimed_epoch_starts_over():
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, max_epoch_steps=5))
    rows = rows_of(4)
    tok, cost = model(TOK, MS)
    for _ in range(12):  # only prefill steps: the full budget stays held, nothing measured
        assert step(ctrl, rows, tok, cost, valid=False) == 15
    state = state_of(ctrl, rows)
    assert all(not c for c in state.costs)
    run(ctrl, rows, tok, cost, 2)
    assert state.cost(3) == pytest.approx(2e-3) and state.held == 2


def test_a_prefill_step_whose_batch_shrank_keeps_the_batchs_bucket():
    """A wave of 16 sampled rows ends together: the next step decodes the 2 rows prefilled ahead while the others'
    prompts are prefilled. That step (a prefill step over fewer rows) is a step of the batch's bucket: its budget (plain
    decoding here), no switch, no state of its own; the same few rows without a prefill take their own bucket's budget
    (a small bucket's search starts larger), and a prefill step over more rows than the step before its own bucket's."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=100))
    big, few = rows_of(16, greedy=False), rows_of(2, greedy=False)
    tok, cost = model({0: 1.0, 3: 1.05, 7: 1.1, 15: 1.1}, MS)  # plain decoding is the best at 16 rows
    run(ctrl, big, tok, cost, 60)
    assert held(ctrl, big) == 0 and not state_of(ctrl, big).searching
    ctrl.timing_valid = False  # (the engine sets it before the step: this step runs a prefill)
    assert ctrl.choose(few) == 0 and not ctrl._switched
    assert ctrl.key(few) not in ctrl.states and ctrl._step[0] is state_of(ctrl, big)
    ctrl.observe_step(5e-3)
    assert ctrl.choose(big) == 0 and not ctrl._switched  # the rows that joined decode: the same bucket, no switch
    ctrl.observe_step(5e-3)
    ctrl.timing_valid = True
    assert ctrl.choose(few) == 15  # a batch that is short without a prefill (its tail): its own bucket
    ctrl.observe_step(1e-3)
    ctrl.timing_valid = False
    assert ctrl.choose(big) == 0 and ctrl._switched  # more rows than the step before: its own bucket
    mixed = rows_of(2, greedy=True)
    ctrl.choose(big)
    assert ctrl.choose(mixed) == 15 and ctrl.key(mixed) in ctrl.states  # (another kind: its own bucket)


def test_a_step_after_a_change_of_budget_is_not_timed():
    """The step after a change of budget runs without the step queued behind the last verify (built under the old
    budget), so it costs a fixed extra 2 ms here; it is left out, and each budget's cost is its own."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=100))
    rows, last = rows_of(64), None
    tok, cost = model(TOK, MS)
    for _ in range(40):
        nodes = ctrl.choose(rows)
        ctrl._step = (ctrl._step[0], [64 * tok(n) for n in NODES[:ctrl._step[0].held + 1]])
        ctrl.observe_step(cost(nodes) + (2e-3 if nodes != last else 0.0))
        last = nodes
    state = state_of(ctrl, rows)
    assert [state.cost(j) for j in range(3)] == pytest.approx([1e-3, 1.3e-3, 1.5e-3])


def test_a_pause_in_one_step_does_not_make_its_budget_look_slow():
    """One step of plain decoding's only epoch takes 30 ms (a pause unrelated to the budget, such as the garbage
    collector): its cost is its epoch's median step, 1 ms."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=100))
    tok, cost = model({0: 1.0, 3: 1.1, 7: 1.2, 15: 1.3}, MS)
    rows = rows_of(16)
    pauses = 0
    for _ in range(40):
        pause = bool(ctrl.states) and held(ctrl, rows) == 0 and state_of(ctrl, rows).timed == 2 and not pauses
        pauses += pause
        step(ctrl, rows, tok, cost, extra=29e-3 if pause else 0.0)
    assert pauses == 1 and held(ctrl, rows) == 0 and state_of(ctrl, rows).cost(0) == pytest.approx(1e-3)


def test_buckets_and_kinds_are_chosen_apart():
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, start_tokens=1 << 20))
    greedy = {0: 1.0, 3: 1.6, 7: 2.2, 15: 3.2}
    sampled = {0: 1.0, 3: 1.1, 7: 1.15, 15: 1.2}
    cost = lambda n: MS[n] * 1e-3  # noqa: E731
    for _ in range(3):
        run(ctrl, rows_of(1), greedy.__getitem__, cost, 12)
        run(ctrl, rows_of(1, greedy=False), sampled.__getitem__, cost, 12)
        run(ctrl, rows_of(33), sampled.__getitem__, cost, 12)  # (bucket 64)
    assert ctrl.key(rows_of(1)) == (1, True) and ctrl.key(rows_of(1, greedy=False)) == (1, False)
    assert held(ctrl, rows_of(1)) == 15
    assert held(ctrl, rows_of(1, greedy=False)) == 0
    assert held(ctrl, rows_of(40)) == 0
    assert ctrl.mean_budget(1) is not None
    assert ctrl.chosen[(33, 15)] == 3  # bucket 64 (greedy) started at greedy bucket 1's 15: a switch and 2 timed


def test_budget_zero_is_required():
    with pytest.raises(ValueError, match="budget 0"):
        EpochBudget(OPTIONS[1:])


def test_the_epoch_log_records_each_epochs_budget_phase_and_rate():
    """The search's epochs (the full tree down to 0) logged as ``search``, then ``hold`` epochs of the best, then a
    probe of budget 0; each with its rate (tokens per row over its median step) and its steps' seconds."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=2))
    tok, cost = model(TOK, MS)
    run(ctrl, rows_of(16), tok, cost, 4 * 5 + 3 * 5)
    log = ctrl.epoch_log()
    assert [(e["nodes"], e["phase"]) for e in log] == [(15, "search"), (7, "search"), (3, "search"), (0, "search"),
                                                         (7, "hold"), (7, "hold"), (0, "probe")]
    assert all(e["bucket"] == 16 and e["greedy"] and e["timed"] == 4 and e["steps"] == 5 for e in log[:4])
    assert [e["t"] for e in log] == sorted(e["t"] for e in log)
    for e in log:
        assert e["rate"] == pytest.approx(TOK[e["nodes"]] / (MS[e["nodes"]] * 1e-3))
        assert e["median_step_s"] == e["max_step_s"] == pytest.approx(MS[e["nodes"]] * 1e-3)
        assert e["best_before"] == (7 if e["phase"] != "search" else 15)
        assert e["shadow_gains"] == {3: None, 7: None, 15: None}  # (no free chains to count)


def test_held_at_plain_decoding_the_larger_budgets_are_probed_too():
    """A search whose first steps ran slow (a new engine) left 7 and 15 dear and the smallest budget, 3, under the
    plain margin: plain decoding is held. Its one neighbour, 3, still measures within the margin, but the probes
    also measure the larger budgets in turn, and 7, at its real cost 25% over plain decoding, is held."""
    tok = {0: 1.0, 3: 1.6, 7: 2.0, 15: 2.2}
    ms = {0: 1.0, 3: 1.45, 7: 1.6, 15: 2.0}  # rates: 0 1.0, 3 1.10, 7 1.25, 15 1.1
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=2, max_hold_epochs=2, plain_margin=0.15))
    rows = rows_of(16)
    seq = []
    for i in range(120):
        slow = i < 12 and NODES.index(held(ctrl, rows) if ctrl.states else 15) >= 2  # the search's first steps
        seq.append(step(ctrl, rows, tok.__getitem__, lambda n, s=slow: (3.0 if s else ms[n]) * 1e-3))
    assert 0 in seq[12:40] and held(ctrl, rows) == 7 and seq[-40:].count(7) > 20


class Row:
    """A sampled row whose committed tokens follow ``text`` (token p is text(p)), one per plain step."""

    def __init__(self, length: int, text, greedy: bool = False) -> None:
        self.params = SimpleNamespace(greedy=greedy)
        self.text, self.tokens, self.finished = text, [text(p) for p in range(length)], False

    def commit(self) -> None:
        self.tokens.append(self.text(len(self.tokens)))


def watched_step(ctrl: EpochBudget, rows: list, tok, cost) -> int:
    """``step``, with ``watch`` where ``speculate`` calls it and each row committing one token."""
    nodes = ctrl.choose(rows)
    ctrl.watch(rows)
    state = ctrl._step[0]
    ctrl._step = (state, [len(rows) * tok(n) for n in NODES[:state.held + 1]])
    for r in rows:
        r.commit()
    ctrl.observe_step(cost(nodes) * 1e-3)
    return nodes


def test_watch_counts_what_each_budget_would_have_committed():
    """A chain looked up at a row's length L would have accepted its longest prefix equal to the tokens the row
    committed from L on: a budget of n commits 1 + min(that prefix, n) tokens. Counted once those tokens are known,
    or once the row ended with fewer."""
    text = {5: 50, 6: 60, 7: 70}.get
    chains = iter([[50, 60, 99, 0], [50], []])
    ctrl = EpochBudget(OPTIONS, short(shadow_rows=1), shadow=lambda req, k: next(chains)[:k])
    row = Row(5, lambda p: text(p, p))
    ctrl.choose([row])
    state = ctrl._step[0]
    state.searching, state.held = False, 0  # (held at plain decoding after its search)
    ctrl.watch([row])
    assert state.shadow == [0] * 5  # (its tokens from 5 on are not known yet)
    for _ in range(4):
        row.commit()
    ctrl.watch([row])  # resolves the first chain (2 of 4 accepted), looks up the second at length 9
    assert state.shadow == [1, 1, 3, 3, 3]
    row.finished = True  # ended at length 9: the second chain's token never came
    ctrl.watch([row])  # (and looks up an empty chain, known at once: one token under every budget)
    assert state.shadow == [3, 3, 5, 5, 5]


@pytest.mark.parametrize("chains", ["none", "wrong", "right"])
def test_plain_decoding_probes_only_budgets_its_free_chains_say_may_pay(chains):
    """Held at plain decoding after its search (speculating gains 5-10% tokens here, short of plain_margin), a
    bucket probes every speculating budget in turn; with free chains (``shadow``) it probes none of them while the
    chains it looks up would commit nothing more than plain decoding, and goes on probing while they would."""
    text = lambda p: p % 11  # noqa: E731 - a row's tokens
    shadow = {"none": None, "wrong": lambda req, k: [99] * k,
              "right": lambda req, k: [text(p) for p in range(len(req.tokens), len(req.tokens) + k)]}[chains]
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=2, max_hold_epochs=2, shadow_min_rows=16),
                       shadow=shadow)
    rows = [Row(12, text) for _ in range(8)]
    tok, cost = model({0: 1.0, 3: 1.05, 7: 1.08, 15: 1.1}, MS)
    seq = [watched_step(ctrl, rows, tok, cost) for _ in range(600)]
    state = state_of(ctrl, rows)
    assert state.best == 0 and seq[-1] == 0
    probes = [e for e in ctrl.epoch_log() if e["phase"] == "probe"]
    if chains == "wrong":
        assert state.shadow[0] >= 16 and state.shadow[1:] == [state.shadow[0]] * 4
        assert len(probes) <= 3  # (only before enough rows were looked up)
    else:
        assert len(probes) > 10 and {e["nodes"] for e in probes} == {3, 7, 15}
    if chains == "right":
        assert state.shadow[2] == 4 * state.shadow[0]  # budget 3: every chain's 3 tokens and the bonus


@pytest.mark.parametrize("wait, greedy", [(1, True), (1 << 30, True), (1, False)])
def test_a_budget_the_free_chains_say_would_be_chosen_is_probed_soon(wait, greedy):
    """A search on text where chains gain nothing holds plain decoding; at step 200 the rows' text turns to one the
    chains predict, where budget 7 pays. Its free chains say so once their counts follow the text, and the budget they
    say would be chosen (15 here: it would commit the most) is probed after shadow_wait epochs, then again after twice
    as many while its kept epochs from the older text keep its rate down, until its counts show 7 pays, and 7 is held.
    With a wait too long, or sampled rows, the probes wait for their turn, and plain decoding is still held at step
    400."""
    rep = {"on": False}
    text = lambda p: p % 11  # noqa: E731 - a row's tokens
    shadow = lambda req, k: ([text(p) for p in range(len(req.tokens), len(req.tokens) + k)] if rep["on"]  # noqa: E731
                             else [99] * k)
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=16, max_hold_epochs=16, shadow_min_rows=16,
                                      shadow_kept=32, shadow_wait=wait), shadow=shadow)
    rows = [Row(12, text, greedy) for _ in range(8)]
    flat = {0: 1.0, 3: 1.0, 7: 1.0, 15: 1.0}
    seq = []
    for i in range(400):
        rep["on"] = i >= 200
        tok = TOK if rep["on"] else flat
        seq.append(watched_step(ctrl, rows, tok.__getitem__, lambda n: MS[n]))
    assert set(seq[100:200]) == {0}  # (the chains said no budget may pay: none was probed)
    first = next(i for i in range(200, 400) if seq[i])
    gains = [e["shadow_gains"] for e in ctrl.epoch_log()]  # (the watch's counts as each epoch ended)
    assert max(g[15] for g in gains if g[15] is not None) > 1 + 0.15 + 0.03  # (budget 15's, once the text turned)
    if wait == 1 and greedy:
        assert first < 200 + 16 + 2 * 4  # the counts follow the text within 16 rows, then one epoch of 4 steps
        assert state_of(ctrl, rows).best == 2 and seq[-100:].count(7) > 80
    else:
        assert first >= 200 + 16 + 2 * 4 and state_of(ctrl, rows).best == 0


@pytest.mark.parametrize("rows, greedy, most", [(16, False, 8), (16, True, 8), (8, False, 8), (16, False, None)])
def test_free_chains_hold_plain_decoding_in_large_sampled_buckets(rows, greedy, most):
    """With free chains, a bucket of more than ``free_sampled_rows`` rows with sampled rows holds plain decoding from
    its first step, however much its chains would gain: no search, no probe, and no chain looked up. A greedy bucket,
    a sampled one of fewer rows, or the field None: the search finds budget 7 (the best here) as without it."""
    text = lambda p: p % 11  # noqa: E731 - a row's tokens; the chains predict it, so every budget would pay
    looked = []

    def shadow(req, k):
        looked.append(k)
        return [text(p) for p in range(len(req.tokens), len(req.tokens) + k)]

    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=2, free_sampled_rows=most), shadow=shadow)
    batch = [Row(12, text, greedy) for _ in range(rows)]
    seq = [watched_step(ctrl, batch, TOK.__getitem__, lambda n: MS[n]) for _ in range(200)]
    fixed = most is not None and not greedy and rows > most
    assert state_of(ctrl, batch).fixed == fixed
    if fixed:
        assert set(seq) == {0} and not looked and {e["phase"] for e in ctrl.epoch_log()} == {"hold"}
        # through ``speculate``: the step is proposed and verified at budget 0, and nothing is timed or counted
        proposer = SimpleNamespace(budget=None, propose=lambda rs: ("proposal", len(rs)))
        verifier = SimpleNamespace(verify_proposal=lambda rs, p: [p] * len(rs))
        ended = len(ctrl.epoch_log())
        for _ in range(50):
            assert ctrl.speculate(batch, proposer, verifier) == [("proposal", rows)] * rows
            assert proposer.budget == 0 and ctrl._step is None
            ctrl.observe_step(1.0)
        assert len(ctrl.epoch_log()) == ended and not looked
    else:
        assert state_of(ctrl, batch).best == 2 and seq[-50:].count(7) > 40
