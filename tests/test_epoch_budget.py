"""The pipelined engine's budget policy (``budget_policy.EpochBudget``) on made-up step timings, without a model.

Each test drives ``choose`` / ``observe_step`` the way ``SpecEngine.step`` does (through a stand-in of
``speculate``'s bookkeeping: tokens committed per step) with rates chosen here, and checks which budget each
(batch bucket, kind) holds.
"""

from __future__ import annotations

from itertools import groupby
from types import SimpleNamespace

import pytest

from specdec.adaptive import BudgetOption
from specdec.budget_policy import EpochBudget, EpochConfig, epoch_rate

OPTIONS = [BudgetOption(n, d, 1) for n, d in ((0, 0), (3, 2), (7, 3), (15, 4))]


def rows_of(n: int, greedy: bool = True) -> list:
    return [SimpleNamespace(params=SimpleNamespace(greedy=greedy if i == 0 else True)) for i in range(n)]


def step(ctrl: EpochBudget, rows: list, rate_of, valid: bool = True) -> int:
    """One engine step: the budget held for ``rows``, committing rate_of(nodes) tokens per second over 1 ms."""
    nodes = ctrl.choose(rows)
    ctrl._step = (ctrl._step[0], rate_of(nodes) * 1e-3)
    ctrl.timing_valid = valid
    ctrl.observe_step(1e-3)
    return nodes


def run(ctrl, rows, rate_of, steps) -> list[int]:
    return [step(ctrl, rows, rate_of) for _ in range(steps)]


def held(ctrl: EpochBudget, rows: list) -> int:
    """The budget the bucket of ``rows`` holds, without taking a step."""
    return ctrl.options[ctrl.states[ctrl.key(rows)].held].nodes


def runs(seq: list[int]) -> list[tuple[int, int]]:
    """(budget, consecutive steps) of a sequence of budgets."""
    return [(n, len(list(g))) for n, g in groupby(seq)]


def short(**kw) -> EpochConfig:
    """Epochs of a few steps whatever the batch (the tests' rates do not vary with the text)."""
    return EpochConfig(**{"epoch_rows": 0, "first_row_steps": 0, **kw})


def test_the_search_descends_from_the_full_tree_until_a_smaller_budget_is_slower_then_measures_plain_decoding():
    """Each budget one epoch of 4 timed steps after an untimed first (the switch), the full tree first; 3 is
    slower than 7, so the descent stops, and budget 0 is measured once (the floor) before 7 is held."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=100))
    rates = {0: 1000.0, 3: 1500.0, 7: 1900.0, 15: 1700.0}
    seq = run(ctrl, rows_of(16), rates.__getitem__, 4 * 5 + 40)
    assert seq[:20] == [15] * 5 + [7] * 5 + [3] * 5 + [0] * 5
    assert set(seq[20:]) == {7}
    assert ctrl.states[ctrl.key(rows_of(16))].rates[0] == pytest.approx(1000.0 / 16)
    report = ctrl.measured()["b16 greedy"]  # what bench JSON records: the held budget first, then each measured
    assert list(report) == [7, 0, 3, 15]
    assert report[3] == pytest.approx(1500.0 / 16, abs=0.1) and report[7] == pytest.approx(1900.0 / 16, abs=0.1)


def test_a_large_batchs_first_measurements_are_short_and_a_small_batchs_epochs_long():
    """Each budget's first measurement ends once it timed 4 steps over 192 rows: 4 steps at 64 rows, 12 at 16,
    192 at one row; later epochs are 16 steps over 256 rows: 16 steps at 16 or 64 rows, 256 at one row. Plain
    decoding commits one token per row whatever the text: its first measurement is 4 timed steps at any batch.
    Each run of a budget starts with one untimed step (the switch)."""
    rates = {0: 1000.0, 3: 1500.0, 7: 1900.0, 15: 1700.0}
    for rows, first, epoch in ((64, 4, 16), (16, 12, 16), (1, 192, 256)):
        ctrl = EpochBudget(OPTIONS, EpochConfig(hold_epochs=100, start_tokens=1 << 20))  # (the full tree first)
        seq = run(ctrl, rows_of(rows), rates.__getitem__, 3 * (first + 1) + 5 + 1 + 2 * epoch)
        assert runs(seq) == [(15, first + 1), (7, first + 1), (3, first + 1), (0, 5), (7, 1 + 2 * epoch)], rows
        state = ctrl.states[ctrl.key(rows_of(rows))]
        assert state.timed == 0 and state.rates[2] == pytest.approx(1900.0 / rows)  # tokens per row-second


def test_a_budget_measured_in_a_batchs_tail_is_judged_per_row():
    """Bucket 64: budget 7 is measured with all 64 rows live, budget 3 while the batch drains (33 rows); per row
    budget 3 commits 10% more per second, so it is held although its steps committed fewer tokens."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=100, start_tokens=1 << 20))
    per_row = {0: 10.0, 3: 22.0, 7: 20.0, 15: 12.0}
    seq = []
    for i in range(4 * 5 + 8):
        live = 33 if i and held(ctrl, rows_of(64)) == 3 else 64
        seq.append(step(ctrl, rows_of(live), lambda n, live=live: per_row[n] * live))
    assert seq[:20] == [15] * 5 + [7] * 5 + [3] * 5 + [0] * 5  # 3 beat 7: its neighbour 0 is measured too
    assert set(seq[20:]) == {3}


def test_plain_decoding_unless_a_budget_beats_it_by_the_plain_margin():
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, plain_margin=0.05))
    seq = run(ctrl, rows_of(64), {0: 1000.0, 3: 1040.0, 7: 1020.0, 15: 900.0}.__getitem__, 12 + 20)
    assert set(seq[12:]) == {0}
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, plain_margin=0.05))
    seq = run(ctrl, rows_of(64), {0: 1000.0, 3: 1060.0, 7: 1020.0, 15: 900.0}.__getitem__, 12 + 20)
    assert set(seq[12:]) == {3}


def test_the_incumbent_is_kept_unless_beaten_by_the_margin():
    """Batch 1, where the full tree and the next smaller cost about the same: 7 measuring 2% faster than 15 (the
    search's start) does not move the choice; 8% faster does."""
    for faster, want in ((1.02, 15), (1.08, 7)):
        ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, margin=0.05))
        rates = {0: 600.0, 3: 1200.0, 7: 2000.0 * faster, 15: 2000.0}
        seq = run(ctrl, rows_of(1), rates.__getitem__, 12 + 20)
        assert seq[:12] == [15] * 3 + [7] * 3 + [3] * 3 + [0] * 3 and set(seq[12:]) == {want}


def test_a_new_bucket_starts_from_the_nearest_measured_bucket_of_its_kind():
    """Bucket 16 settles on 3; bucket 32 then starts at 3 and measures only its neighbours (0, then 7): the full
    tree, slow at large batches, is never run there. Smaller buckets (a batch's tail) start one option larger per
    halving of the batch: 8 at 7, 2 at 15 (the full tree; from 8's 7 had 8 been measured). Sampled steps start their
    own search from the full tree."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, start_tokens=1 << 20))
    rates = {0: 1000.0, 3: 1500.0, 7: 1400.0, 15: 1000.0}
    run(ctrl, rows_of(16), rates.__getitem__, 12)
    assert held(ctrl, rows_of(16)) == 3
    seq = run(ctrl, rows_of(32), rates.__getitem__, 9 + 10)
    assert seq[:9] == [3] * 3 + [0] * 3 + [7] * 3 and set(seq[9:]) == {3}
    assert run(ctrl, rows_of(8), rates.__getitem__, 2) == [7, 7]
    assert run(ctrl, rows_of(2), rates.__getitem__, 2) == [15, 15]
    assert run(ctrl, rows_of(32, greedy=False), rates.__getitem__, 2) == [15, 15]


def test_a_search_starts_no_higher_than_its_verify_token_cap():
    """With no bucket measured and the default cap (512 tokens), batches 16 and 32 start at 15 (32 x 16 tokens) and
    64 at 7 (64 x 8); 64 inheriting 15 from a measured bucket 16 starts at 7 all the same, and a bucket past every
    cap at the smallest speculating budget. The search from there still measures the neighbours (15 above, when 7
    beats 3) and plain decoding."""
    rates = {0: 1000.0, 3: 1500.0, 7: 1900.0, 15: 2100.0}
    for rows, start in ((16, 15), (17, 15), (33, 7)):
        ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100))
        assert step(ctrl, rows_of(rows), rates.__getitem__) == start, rows
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100))
    run(ctrl, rows_of(16), rates.__getitem__, 12)
    assert held(ctrl, rows_of(16)) == 15
    seq = run(ctrl, rows_of(64), rates.__getitem__, 12)
    assert seq[:3] == [7] * 3 and 15 in seq and 0 in seq and 3 in seq
    tiny_cap = EpochBudget(OPTIONS, short(epoch_steps=2, start_tokens=8))
    assert step(tiny_cap, rows_of(64), rates.__getitem__) == 3


def test_neighbours_are_probed_and_a_drift_moves_the_choice():
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=3, max_hold_epochs=6, window=1))
    rates = {0: 1000.0, 3: 1500.0, 7: 2000.0, 15: 1200.0}
    held = run(ctrl, rows_of(8), lambda n: rates[n], 6 + 60)
    assert 15 in held[6:] and 3 in held[6:]  # both neighbours of 7 probed, an epoch each
    assert held[6:].count(7) > 0.6 * len(held[6:])
    rates[3] = 3000.0  # the text changed: smaller trees pay now
    held = run(ctrl, rows_of(8), lambda n: rates[n], 60)
    assert ctrl.options[ctrl.states[ctrl.key(rows_of(8))].best].nodes == 3
    assert held[-30:].count(3) > 0.6 * 30  # held, but for the probes of its neighbours


def test_probes_that_change_nothing_come_less_often():
    """Epochs of one timed step; each run of a budget starts with an untimed step (the switch)."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=1, hold_epochs=2, max_hold_epochs=8))
    rates = {0: 1000.0, 3: 1500.0, 7: 2000.0, 15: 1200.0}
    seq = run(ctrl, rows_of(8), rates.__getitem__, 8 + 50)
    assert runs(seq[:8]) == [(15, 2), (7, 2), (3, 2), (0, 2)]
    held_runs = runs(seq[8:])
    assert all(n != 7 and k == 2 for n, k in held_runs[1::2])  # the probes: one epoch each
    assert [k - 1 for n, k in held_runs[0:-1:2]][:4] == [2, 4, 8, 8]  # held 2 epochs, then 4, then at most 8


def test_plain_decoding_is_probed_until_measured_then_while_in_reach():
    """Budget 0 is measured once by the search, then probed (first, then above and below in turn) although it is
    no neighbour of the held budget (7: its neighbours are 3 and 15), until it has ``window`` epochs; with the best
    twice as fast it is then left alone (a probe would cost an epoch at half the rate and move nothing), until the
    best's own rate falls within ``plain_reach`` of it."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=2, max_hold_epochs=4))
    rates = {0: 1000.0, 3: 900.0, 7: 2000.0, 15: 800.0}
    rows = rows_of(8)
    seq = run(ctrl, rows, rates.__getitem__, 12 + 200)
    probes = [n for n, _ in runs(seq[12:]) if n != 7]
    assert probes[:3] == [0, 15, 3] and probes.count(0) == 2  # 3 epochs of 0 in all, with the search's
    state = ctrl.states[ctrl.key(rows)]
    assert len(state.history[0]) == 3 and ctrl.options[state.best].nodes == 7
    rates[7] = 1150.0  # the best's acceptance fell: 15% over plain decoding, in reach of it
    seq = run(ctrl, rows, rates.__getitem__, 80)
    assert 0 in seq and ctrl.options[state.best].nodes == 7  # probed again; 7 still beats it by the plain margin


def until_epoch_of(ctrl: EpochBudget, rows: list, rate_of, nodes: int) -> None:
    """Steps until an epoch of budget ``nodes`` has ended."""
    ended = len(ctrl.epochs)
    for _ in range(1000):
        step(ctrl, rows, rate_of)
        if len(ctrl.epochs) > ended and ctrl.epochs[-1]["nodes"] == nodes:
            return
        ended = len(ctrl.epochs)
    raise AssertionError(f"no epoch of budget {nodes} in 1,000 steps")


def test_a_budgets_rate_is_the_median_of_its_latest_epochs():
    """One epoch far from a budget's others (slowed by what no budget causes) moves nothing, whether it is the held
    budget's or plain decoding's; a second one that agrees with it does."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=2, max_hold_epochs=2))
    rates = {0: 1700.0, 3: 1500.0, 7: 2000.0, 15: 1200.0}  # (budget 0 in reach of the best: probed in turn)
    rows = rows_of(8)
    state = ctrl.states.setdefault(ctrl.key(rows), ctrl._new_state(ctrl.key(rows)))
    run(ctrl, rows, rates.__getitem__, 12 + 60)  # the search, then held 7, each neighbour and 0 probed in turn
    assert [len(h) for h in state.history] == [3, 3, 3, 3] and ctrl.options[state.best].nodes == 7
    slow = dict(rates)
    slow[7] = 500.0
    until_epoch_of(ctrl, rows, slow.__getitem__, 7)  # one slow epoch of the held budget
    assert state.rates[2] == pytest.approx(2000.0 / 8) and ctrl.options[state.best].nodes == 7
    rates[0] = 2500.0  # plain decoding measures faster than the held budget: once moves nothing, twice moves it
    until_epoch_of(ctrl, rows, rates.__getitem__, 0)
    assert ctrl.options[state.best].nodes == 7 and state.held == 2
    until_epoch_of(ctrl, rows, rates.__getitem__, 0)
    assert state.rates[0] == pytest.approx(2500.0 / 8) and state.best == 0


def test_the_plain_margin_is_for_batches():
    """A budget measuring 6% more tokens per row-second than plain decoding: held at one row, where nothing waits
    for it; not in a batch, where its rows' uneven ends cost a continuous batch what its per-row rate does not see
    (the default plain_margin, 8%)."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, start_tokens=1 << 20))
    rates = {0: 1000.0, 3: 1060.0, 7: 900.0, 15: 800.0}
    run(ctrl, rows_of(1), rates.__getitem__, 20)
    run(ctrl, rows_of(16), rates.__getitem__, 20)
    assert held(ctrl, rows_of(1)) == 3 and held(ctrl, rows_of(16)) == 0


def test_buckets_and_kinds_are_chosen_apart():
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, start_tokens=1 << 20))
    greedy = {0: 1000.0, 3: 1200.0, 7: 1500.0, 15: 2000.0}
    sampled = {0: 1000.0, 3: 900.0, 7: 800.0, 15: 700.0}
    for _ in range(3):
        run(ctrl, rows_of(1), greedy.__getitem__, 12)
        run(ctrl, rows_of(1, greedy=False), sampled.__getitem__, 12)
        run(ctrl, rows_of(33), sampled.__getitem__, 12)  # (bucket 64)
    assert ctrl.key(rows_of(1)) == (1, True) and ctrl.key(rows_of(1, greedy=False)) == (1, False)
    assert held(ctrl, rows_of(1)) == 15
    assert held(ctrl, rows_of(1, greedy=False)) == 0
    assert held(ctrl, rows_of(40)) == 0
    assert ctrl.mean_budget(1) is not None
    assert ctrl.chosen[(33, 15)] == 3  # bucket 64 (greedy) started at greedy bucket 1's 15: a switch and 2 timed


def test_steps_with_a_prefill_are_not_timed_and_an_untimed_epoch_starts_over():
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, max_epoch_steps=5))
    rows = rows_of(4)
    for _ in range(12):  # only prefill steps: the full budget stays held, nothing measured
        assert step(ctrl, rows, lambda n: 1e6, valid=False) == 15
    state = ctrl.states[ctrl.key(rows)]
    assert state.rates == [None] * 4
    step(ctrl, rows, lambda n: 1000.0)
    step(ctrl, rows, lambda n: 1000.0)
    assert state.rates[3] == pytest.approx(1000.0 / 4) and state.held == 2  # per row


def test_a_step_after_a_change_of_budget_is_not_timed():
    """The step after a change of budget runs without the step queued behind the last verify (built under the old
    budget), so it costs a fixed extra 2 ms here. Plain decoding (1 ms a step, one token per row) is 3.3% faster per
    row than budget 3 (1.6 ms, 1.55 tokens): the switch's cost, if timed, would make a 4-step epoch of budget 0
    look slower (6 ms for 4 tokens) than one of budget 3 (8.4 ms for 6.2); untimed, budget 0 is held."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=100, margin=0.0, plain_margin=0.0))
    cost = {0: (1e-3, 1.0), 3: (1.6e-3, 1.55), 7: (2.4e-3, 1.7), 15: (4e-3, 1.8)}
    rows, last, seq = rows_of(64), None, []
    for _ in range(60):
        nodes = ctrl.choose(rows)
        seconds, tokens = cost[nodes]
        ctrl._step = (ctrl._step[0], tokens * 64)
        ctrl.observe_step(seconds + (2e-3 if nodes != last else 0.0))
        last = nodes
        seq.append(nodes)
    assert set(seq[25:]) == {0}
    rates = ctrl.states[ctrl.key(rows)].rates
    assert rates[0] == pytest.approx(1.0 / 1e-3) and rates[1] == pytest.approx(1.55 / 1.6e-3)


def test_budget_zero_is_required():
    with pytest.raises(ValueError, match="budget 0"):
        EpochBudget(OPTIONS[1:])


def test_the_epoch_log_records_each_epochs_budget_phase_and_rate():
    """The search's epochs (the full tree down to 3, then 0) logged as ``search``, then ``hold`` epochs of the best,
    then a probe of a neighbour; each with the rate it measured and its steps' median and longest seconds."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=2))
    rates = {0: 1000.0, 3: 1500.0, 7: 1900.0, 15: 1700.0}
    run(ctrl, rows_of(16), rates.__getitem__, 4 * 5 + 3 * 5)
    log = ctrl.epoch_log()
    assert [(e["nodes"], e["phase"]) for e in log] == [(15, "search"), (7, "search"), (3, "search"), (0, "search"),
                                                         (7, "hold"), (7, "hold"), (0, "probe")]
    assert all(e["bucket"] == 16 and e["greedy"] and e["timed"] == 4 and e["steps"] == 5 for e in log[:4])
    assert [e["t"] for e in log] == sorted(e["t"] for e in log)
    for e in log:
        assert e["rate"] == pytest.approx(rates[e["nodes"]] / 16, abs=0.1)
        assert e["median_step_s"] == e["max_step_s"] == pytest.approx(1e-3)
        assert e["best_before"] == (7 if e["phase"] != "search" else 15)


def test_a_pause_in_one_step_does_not_make_its_budget_look_slow():
    """Plain decoding is the fastest here; one step of its only epoch takes 30 ms (a pause unrelated to the budget,
    such as the garbage collector). Judged by the epoch's mean step it would measure a ninth of its rate and the
    controller would hold budget 3; by its median step it measures its rate and is
    held."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=100))
    rates = {0: 1000.0, 3: 900.0, 7: 800.0, 15: 700.0}
    rows = rows_of(16)
    paused = False
    for _ in range(60):
        nodes = ctrl.choose(rows)
        ctrl._step = (ctrl._step[0], rates[nodes] * 1e-3)
        ctrl.timing_valid = True
        pause = nodes == 0 and not paused and ctrl.states[ctrl.key(rows)].timed == 2
        paused = paused or pause
        ctrl.observe_step(30e-3 if pause else 1e-3)
    assert paused and held(ctrl, rows) == 0
    assert ctrl.states[ctrl.key(rows)].rates[0] == pytest.approx(1000.0 / 16)


def test_an_epochs_rate_is_its_tokens_per_row_over_its_median_step():
    """(seconds, tokens, rows) per step, 16 rows: steps dearer than the median (the first after rows joined, which
    ran without overlap; a pause) leave the rate as it is, while the tokens of every step count; rows in the tail of
    a batch count per row."""
    plain = [(1e-3, 16.0, 16)] * 12
    assert epoch_rate(plain) == pytest.approx(1000.0)
    joins = [(1e-3, 16.0, 16)] * 9 + [(2.5e-3, 16.0, 16)] * 3
    assert epoch_rate(joins) == pytest.approx(1000.0)
    assert epoch_rate(plain + [(30e-3, 16.0, 16)]) == pytest.approx(1000.0)
    varied = [(1e-3, 16.0, 16), (1.1e-3, 32.0, 16), (1.2e-3, 24.0, 16)]  # the text's tokens, a dearer median
    assert epoch_rate(varied) == pytest.approx(72 / 48 / 1.1e-3)
    assert epoch_rate([(2e-3, 24.0, 8), (1e-3, 16.0, 16)]) == pytest.approx(40 / 24 / 1.5e-3)  # per row
    assert epoch_rate([(1e-3, 16.0, 16)] * 3 + [(1.2e-3, 16.0, 16)] * 4) == pytest.approx(1 / 1.2e-3)  # a dearer half
