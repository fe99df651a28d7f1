"""The pipelined engine's budget policy (``adaptive.EpochBudget``) on made-up step timings, without a model.

Each test drives ``choose`` / ``observe_step`` the way ``SpecEngine.step`` does (through a stand-in of
``speculate``'s bookkeeping: tokens committed per step) with rates chosen here, and checks which budget each
(batch bucket, kind) holds.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specdec.adaptive import BudgetOption, EpochBudget, EpochConfig

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


def short(**kw) -> EpochConfig:
    """Epochs of a few steps whatever the batch (the tests' rates do not vary with the text)."""
    return EpochConfig(**{"epoch_rows": 0, "first_row_steps": 0, **kw})


def test_the_search_descends_from_the_full_tree_until_a_smaller_budget_is_slower():
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=100))
    rates = {0: 1000.0, 3: 1500.0, 7: 1900.0, 15: 1700.0}
    held = run(ctrl, rows_of(16), rates.__getitem__, 4 * 4 + 40)
    assert held[:12] == [15] * 4 + [7] * 4 + [3] * 4  # each budget one epoch, full tree first; 3 is slower: stop
    assert set(held[12:]) == {7}  # then the fastest, for whole epochs; budget 0 was never paid for
    assert ctrl.states[ctrl.key(rows_of(16))].rates[0] is None


def test_a_large_batchs_first_measurements_are_short_and_a_small_batchs_epochs_long():
    """Each budget's first measurement ends once it timed 4 steps over 192 rows: 4 steps at 64 rows, 12 at 16,
    192 at one row; later epochs are 16 steps over 256 rows: 16 steps at 16 or 64 rows, 256 at one row."""
    rates = {0: 1000.0, 3: 1500.0, 7: 1900.0, 15: 1700.0}
    for rows, first, epoch in ((64, 4, 16), (16, 12, 16), (1, 192, 256)):
        ctrl = EpochBudget(OPTIONS, EpochConfig(hold_epochs=100))
        held = run(ctrl, rows_of(rows), rates.__getitem__, 3 * first + 2 * epoch)
        assert held[:3 * first] == [15] * first + [7] * first + [3] * first, rows
        assert set(held[3 * first:]) == {7}
        state = ctrl.states[ctrl.key(rows_of(rows))]
        assert state.timed == 0 and state.rates[2] == pytest.approx(1900.0 / rows)  # tokens per row-second


def test_a_budget_measured_in_a_batchs_tail_is_judged_per_row():
    """Bucket 64: budget 7 is measured with all 64 rows live, budget 3 while the batch drains (33 rows); per row
    budget 3 commits 10% more per second, so it is held although its steps committed fewer tokens."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=4, hold_epochs=100))
    per_row = {0: 10.0, 3: 22.0, 7: 20.0, 15: 12.0}
    held = []
    for _ in range(4 * 4 + 8):
        live = 33 if ctrl.choose(rows_of(64)) == 3 else 64
        held.append(step(ctrl, rows_of(live), lambda n, live=live: per_row[n] * live))
    assert held[:16] == [15] * 4 + [7] * 4 + [3] * 4 + [0] * 4  # 3 beat 7: its neighbour 0 is measured too
    assert set(held[16:]) == {3}


def test_plain_decoding_unless_a_budget_beats_it_by_the_margin():
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, margin=0.05))
    held = run(ctrl, rows_of(64), {0: 1000.0, 3: 1040.0, 7: 1020.0, 15: 900.0}.__getitem__, 8 + 20)
    assert set(held[8:]) == {0}
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, margin=0.05))
    held = run(ctrl, rows_of(64), {0: 1000.0, 3: 1060.0, 7: 1020.0, 15: 900.0}.__getitem__, 8 + 20)
    assert set(held[8:]) == {3}


def test_the_incumbent_is_kept_unless_beaten_by_the_margin():
    """Batch 1, where the full tree and the next smaller cost about the same: 7 measuring 2% faster than 15 (the
    search's start) does not move the choice; 8% faster does."""
    for faster, want in ((1.02, 15), (1.08, 7)):
        ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100, margin=0.05))
        rates = {0: 600.0, 3: 1200.0, 7: 2000.0 * faster, 15: 2000.0}
        held = run(ctrl, rows_of(1), rates.__getitem__, 6 + 20)
        assert held[:6] == [15, 15, 7, 7, 3, 3] and set(held[6:]) == {want}


def test_a_new_bucket_starts_from_the_nearest_measured_bucket_of_its_kind():
    """Bucket 64 settles on 3; bucket 32 then starts at 3 and measures only its neighbours (0, then 7): the full
    tree, slow at large batches, is never run there. Sampled steps start their own search from the full tree."""
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100))
    rates = {0: 1000.0, 3: 1500.0, 7: 1400.0, 15: 1000.0}
    run(ctrl, rows_of(64), rates.__getitem__, 12)
    assert ctrl.choose(rows_of(64)) == 3
    held = run(ctrl, rows_of(32), rates.__getitem__, 6 + 10)
    assert held[:6] == [3, 3, 0, 0, 7, 7] and set(held[6:]) == {3}
    assert run(ctrl, rows_of(32, greedy=False), rates.__getitem__, 2) == [15, 15]


def test_neighbours_are_probed_and_a_drift_moves_the_choice():
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=3, max_hold_epochs=6, alpha=1.0))
    rates = {0: 1000.0, 3: 1500.0, 7: 2000.0, 15: 1200.0}
    held = run(ctrl, rows_of(8), lambda n: rates[n], 6 + 60)
    assert 15 in held[6:] and 3 in held[6:]  # both neighbours of 7 probed, an epoch each
    assert held[6:].count(7) > 0.6 * len(held[6:])
    rates[3] = 3000.0  # the text changed: smaller trees pay now
    held = run(ctrl, rows_of(8), lambda n: rates[n], 60)
    assert ctrl.options[ctrl.states[ctrl.key(rows_of(8))].best].nodes == 3
    assert held[-30:].count(3) > 0.6 * 30  # held, but for the probes of its neighbours


def test_probes_that_change_nothing_come_less_often():
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=1, hold_epochs=2, max_hold_epochs=8))
    rates = {0: 1000.0, 3: 1500.0, 7: 2000.0, 15: 1200.0}
    held = run(ctrl, rows_of(8), rates.__getitem__, 3 + 40)[3:]
    probes = [i for i, n in enumerate(held) if n != 7]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [4, 8, 8, 8]  # held 2 epochs, then 4, then at most 8 between probes


def test_buckets_and_kinds_are_chosen_apart():
    ctrl = EpochBudget(OPTIONS, short(epoch_steps=2, hold_epochs=100))
    greedy = {0: 1000.0, 3: 1200.0, 7: 1500.0, 15: 2000.0}
    sampled = {0: 1000.0, 3: 900.0, 7: 800.0, 15: 700.0}
    for _ in range(12):
        step(ctrl, rows_of(1), greedy.__getitem__)
        step(ctrl, rows_of(1, greedy=False), sampled.__getitem__)
        step(ctrl, rows_of(33), sampled.__getitem__)  # (bucket 64)
    assert ctrl.key(rows_of(1)) == (1, True) and ctrl.key(rows_of(1, greedy=False)) == (1, False)
    assert ctrl.choose(rows_of(1)) == 15
    assert ctrl.choose(rows_of(1, greedy=False)) == 0
    assert ctrl.choose(rows_of(40)) == 0
    assert ctrl.mean_budget(1) is not None and ctrl.chosen[(33, 15)] == 2


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


def test_budget_zero_is_required():
    with pytest.raises(ValueError, match="budget 0"):
        EpochBudget(OPTIONS[1:])
