"""Adaptive speculation: the budget controller on synthetic costs and acceptance, and the engine with it on.

Controller tests drive ``BudgetController`` with cost tables and accepted lengths made up here (no
model). Engine tests (tiny random pair of conftest, float32) check that greedy output equals
target-only output whatever budgets are chosen, and that injected cost tables move the budgets.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch

from specdec.adaptive import (
    AdaptiveConfig,
    BudgetController,
    BudgetOption,
    DepthAcceptance,
    StepCosts,
    batch_key,
    budget_options,
    query_key,
)
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import SpecConfig, SpecEngine
from specdec.errors import FieldError
from specdec.graphs import QUERY_BUCKETS
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

CHAIN8 = budget_options(NgramDrafter(8))  # n-gram chain:8: budgets 0..8, one lookup each


def flat_table(batches=(1, 16, 64), base=1e-3):
    """Verify costs that do not grow with the query bucket (a cheap tree verify)."""
    return {(b, q): base for b in batches for q in QUERY_BUCKETS}


def steep_table(batches=(1, 16, 64), base=1e-3):
    """Verify costs proportional to the tokens of the step (a compute-bound large batch)."""
    return {(b, q): base * q for b in batches for q in QUERY_BUCKETS}


def run(ctrl: BudgetController, rows: int, accepted_of, steps: int) -> list[int]:
    """``steps`` choose/observe rounds; accepted_of(budget) -> accepted tokens per row; each verify takes
    what the controller's table says. Returns the budgets."""
    out = []
    for _ in range(steps):
        n = ctrl.choose(rows)
        seconds = ctrl.costs.table[(batch_key(rows), query_key(n + 1))]
        ctrl.observe(rows, n + 1, [accepted_of(n)] * rows, 0.0, seconds)
        out.append(n)
    return out


def test_options_per_drafter_kind():
    assert [o.nodes for o in CHAIN8] == list(range(9)) and CHAIN8[0] == BudgetOption(0, 0, 0)
    ctrl = BudgetController(CHAIN8)  # equal cost within a query bucket: only the deepest of each is kept
    assert [o.nodes for o in ctrl.options] == [0, 1, 3, 7, 8]


def test_cheap_verify_and_high_acceptance_choose_the_largest_budget():
    ctrl = BudgetController(CHAIN8, cost_table=flat_table())
    budgets = run(ctrl, 16, lambda n: n, 40)  # every drafted token accepted
    assert budgets[-10:] == [8] * 10


def test_steep_verify_cost_at_large_batch_chooses_plain_decoding():
    ctrl = BudgetController(CHAIN8, cost_table=steep_table())
    budgets = run(ctrl, 64, lambda n: min(n, 1), 64)  # ~1 token accepted: never worth a 2x-16x verify
    cfg = ctrl.config
    plain = [n for i, n in enumerate(budgets, 1) if i % cfg.probe_interval]
    assert plain[-20:] == [0] * 20
    # the same acceptance at batch 1 with a flat cost still speculates
    assert run(BudgetController(CHAIN8, cost_table=flat_table()), 1, lambda n: min(n, 1), 20)[-1] > 0


def test_falling_acceptance_lowers_the_budget():
    table = {(16, q): 1e-3 * (1 + 0.05 * q) for q in QUERY_BUCKETS}  # mildly growing verify cost
    ctrl = BudgetController(CHAIN8, cost_table=table)
    high = run(ctrl, 16, lambda n: n, 30)
    low = run(ctrl, 16, lambda n: 0, 60)  # acceptance collapses: nothing is accepted any more
    assert high[-1] == 7  # 8 tokens for a 1.4 ms verify (Q=8) beat 9 for 1.8 ms (Q=16)
    assert max(low[-10:]) < high[-1] and low[-1] == 0


def test_reprobing_after_plain_decoding_finds_acceptance_again():
    table = {(16, q): 1e-3 * (1 + 0.05 * q) for q in QUERY_BUCKETS}
    ctrl = BudgetController(CHAIN8, AdaptiveConfig(probe_interval=4), cost_table=table)
    run(ctrl, 16, lambda n: 0, 40)
    assert ctrl.choose(16) in (0, 1)  # settled on (almost) plain decoding
    budgets = run(ctrl, 16, lambda n: n, 80)  # acceptance comes back: only probes can see it
    assert budgets[-1] == 7


def test_online_costs_explore_unseen_buckets_then_interpolate():
    costs = StepCosts(alpha=0.5)
    assert costs.verify(16, 4) is None
    costs.observe_verify(16, 1, 1.0)
    costs.observe_verify(16, 8, 2.4)
    assert costs.verify(16, 4) == pytest.approx(1.0 + 1.4 * 3 / 7)  # linear between the seen buckets
    assert costs.verify(16, 16) == pytest.approx(2.4 + 0.2 * 8)  # past them: the last segment's slope
    costs.observe_verify(16, 8, 3.4)
    assert costs.verify(16, 8) == pytest.approx(2.9)  # EMA
    # without a table the controller first tries every query bucket its options use, largest first
    ctrl = BudgetController(CHAIN8)
    firsts = []
    for _ in range(5):
        firsts.append(ctrl.choose(16))
        ctrl.observe(16, firsts[-1] + 1, [0] * 16, 0.0, 1e-3)
    assert firsts == [8, 7, 3, 1, 0]


def test_depth_acceptance_counts_short_trees_as_misses():
    acc = DepthAcceptance(4, prior=0.8, weight=1e-6, memory=100.0)
    acc.observe(4, [0, 1, 4, 4])  # rows reaching depth 0: 4 (3 hit), depth 1: 3 (2 hit), depth 2, 3: 2 (2 hit)
    assert acc.rates == pytest.approx([0.75, 2 / 3, 1.0, 1.0], abs=1e-5)
    assert acc.expected()[2] == pytest.approx(1 + 0.75 + 0.5, abs=1e-5)


def test_config_errors_name_the_field():
    with pytest.raises(FieldError, match="probe_interval"):
        AdaptiveConfig(probe_interval=0)
    with pytest.raises(FieldError, match="adaptive"):
        SpecConfig(adaptive="yes")


# ---------------------------------------------------------------- engine


def _prompts():
    g = torch.Generator().manual_seed(7)
    base = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 23, 14, 31)]
    return [p + p[:6] for p in base]  # a repeated span gives the n-gram drafter matches


@pytest.fixture(scope="module")
def reference(tiny_target):
    eng = SpecEngine(None, tiny_target, SpecConfig(num_blocks=256, block_size=8))
    return [o.token_ids for o in eng.generate(_prompts(), SamplingParams(max_new_tokens=20, ignore_eos=True))]


@pytest.mark.parametrize("draft,tree,graphs", [("ngram", "chain:8", False), ("model", "chain:4", True),
                                               ("model", "dynamic:16", False), ("model", "topk:2x3", False)])
def test_adaptive_greedy_equals_target_only(tiny_target, tiny_draft, reference, draft, tree, graphs):
    d = {"ngram": "ngram", "model": tiny_draft}[draft]
    eng = SpecEngine(d, tiny_target, SpecConfig(tree=tree, num_blocks=256, block_size=8, adaptive=True,
                                                cuda_graphs=graphs))
    assert eng.adaptive is not None
    outs = eng.generate(_prompts(), SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference
    assert eng.all_blocks_free()
    assert sum(eng.adaptive.chosen.values()) > 0 and eng.stats.drafted > 0


def test_injected_cost_tables_move_the_budget(tiny_target, reference):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    got = {}
    for name, table in (("flat", flat_table((1, 2, 4), 1.0)), ("steep", steep_table((1, 2, 4), 1.0))):
        eng = SpecEngine(tiny_target, tiny_target, SpecConfig(tree="chain:8", num_blocks=256, block_size=8,
                                                              adaptive=True))
        ctrl = eng.adaptive = BudgetController(budget_options(eng.drafter), AdaptiveConfig(probe_interval=64), table)
        for learn in ("observe_verify", "observe_draft", "observe_other"):  # costs = the table, not wall times
            setattr(ctrl.costs, learn, lambda *a: None)
        assert [o.token_ids for o in eng.generate(_prompts(), params)] == reference
        got[name] = (ctrl.mean_budget(), eng.stats.drafted, eng.stats.target_forwards)
    # the draft is the target itself (everything accepted): equal verify costs take full chains, steep ones none
    assert got["flat"][0] == 8 and got["flat"][1] == 8 * got["flat"][2], got
    assert got["steep"][0] == 0 and got["steep"][1] == 0, got


class Scripted(BudgetController):
    """Cycles through every option (0 included) and records (budget, largest tree) per step."""

    def __init__(self, options):
        super().__init__(options)
        self.turn, self.sizes = 0, []

    def choose(self, rows: int) -> int:
        self.last = self.options[self.turn % len(self.options)]
        self.turn += 1
        return self.last.nodes

    def observe(self, rows, query, accepted, propose_s, verify_s) -> None:
        self.sizes.append((self.last.nodes, query - 1))


def _eagle(tiny_target):
    from specdec.loading.registry import LoadedModel
    from specdec.models.eagle import EagleShape, default_aux_layers, eagle_from_target

    shape = EagleShape(default_aux_layers(tiny_target.config.num_layers), 100)
    model = eagle_from_target(tiny_target.model, shape, torch.arange(0, 200, 2), seed=2).eval().requires_grad_(False)
    return LoadedModel("eagle", model, None, model.config)


@pytest.mark.parametrize("draft,tree", [("eagle", "chain:3"), ("eagle", "dynamic:12"), ("eagle", "topk:2x2"),
                                        ("model", "dynamic:16"), ("ngram", "chain:6")])
def test_every_budget_bounds_the_trees_and_output_stays_exact(tiny_target, tiny_draft, reference, draft, tree):
    d = {"eagle": _eagle(tiny_target) if draft == "eagle" else None, "model": tiny_draft, "ngram": "ngram"}[draft]
    eng = SpecEngine(d, tiny_target, SpecConfig(tree=tree, num_blocks=256, block_size=8, adaptive=True))
    eng.adaptive = ctrl = Scripted(budget_options(eng.drafter))
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    assert [o.token_ids for o in eng.generate(_prompts(), params)] == reference
    assert eng.all_blocks_free()
    assert all(size <= n for n, size in ctrl.sizes)  # no tree outgrows its budget
    if draft != "ngram":  # a draft model grows every budget (0 too) in full
        assert {n for n, size in ctrl.sizes if size == n} == {o.nodes for o in ctrl.options}
    sampled = eng.generate(_prompts(), SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in sampled) and eng.all_blocks_free()  # sampled trees obey budgets too
    assert all(size <= n for n, size in ctrl.sizes)


def test_measure_costs_times_every_bucket_without_writing_kv(tiny_target):
    eng = SpecEngine("ngram", tiny_target, SpecConfig(tree="chain:4", num_blocks=64, block_size=8, max_batch_size=4,
                                                      cuda_graphs=True))
    eng.pool.storage.normal_()
    before = eng.pool.storage.clone()
    costs = eng.runner.graphs.measure_costs(context=20, repeats=1)
    assert set(costs) == {(b, q) for b in (1, 2, 4) for q in (1, 2, 4, 5)}  # the top query bucket: 4 + 1 tokens
    assert all(c > 0 for c in costs.values())
    assert torch.equal(eng.pool.storage, before)  # every slot was padding: nothing stored


def test_steps_with_a_prefill_teach_acceptance_but_no_costs():
    ctrl = BudgetController(CHAIN8)
    ctrl.timing_valid = False
    n = ctrl.choose(16)
    ctrl.observe(16, n + 1, [n] * 16, 0.5, 9.0)
    assert ctrl.costs.seen == {} and ctrl.costs.draft == {} and ctrl.costs.tries == {}
    assert ctrl.acceptance.rates[0] > AdaptiveConfig().prior_rate  # all accepted: the rate rose


def test_bench_reports_the_mean_budget_per_batch_size():
    from specdec.benchmark.report import budget_line

    report = {"sweep": [{"batch_size": 1, "mean_budget": 7.5}, {"batch_size": 16, "mean_budget": 0.25},
                        {"batch_size": 64, "mean_budget": None}]}
    assert budget_line(report) == "adaptive tree budget (mean nodes per step): batch 1: 7.50, batch 16: 0.25\n"
    assert budget_line({"sweep": [{"batch_size": 1}]}) == ""  # adaptive off: no line
    ctrl = BudgetController(CHAIN8)
    for rows, n in ((16, 8), (16, 0), (4, 3)):
        ctrl.chosen[(rows, n)] += 1
    mark = ctrl.chosen.copy()
    ctrl.chosen[(16, 1)] += 3
    assert ctrl.mean_budget(16) == pytest.approx(11 / 5) and ctrl.mean_budget(since=mark) == 1.0


def test_template_tree_cuts_a_whole_template_to_the_budget():
    from specdec.adaptive import template_tree
    from specdec.tree_spec import topk_template

    tpl = topk_template(2, 2)  # 2 + 4 nodes, level order
    tokens = [10, 11, 12, 13, 14, 15]
    assert template_tree(tokens, tpl, 0).num_nodes == 0
    two = template_tree(tokens, tpl, 2)
    assert two.host.tokens == [10, 11] and two.host.parents == [-1, -1]
    assert template_tree(tokens, tpl, 6).host.parents == list(tpl.parents)


def test_options_of_draft_models_per_tree_kind():
    from types import SimpleNamespace

    from specdec.drafters.eagle_dynamic import DynamicShape
    from specdec.tree_spec import template_from_spec

    def opts(tree, loop=None):
        spec = template_from_spec(tree)
        return budget_options(SimpleNamespace(max_nodes=spec.budget, uses_kv=True, spec=spec, device_loop=loop,
                                              _max_depth=min(10, spec.budget)))

    assert opts("chain:3") == [(0, 0, 1), (1, 1, 1), (2, 2, 2), (3, 3, 3)]  # (nodes, depth, draft forwards)
    assert opts("topk:2x2") == [(0, 0, 1), (2, 1, 1), (6, 2, 2)]  # whole levels of the template
    assert opts("topk:2x2", loop=object()) == [(0, 0, 1), (2, 1, 1), (6, 2, 1)]  # one device program
    assert opts("dynamic:16") == [(0, 0, 1)] + [(2 * d, d, d) for d in range(1, 9)]  # 2 nodes per level
    assert opts("dynamic:12:3x5") == [(0, 0, 1)] + [(3 * d, d, d) for d in range(1, 5)]  # the spec's width
    device = SimpleNamespace(shape=DynamicShape(8, 4, 28))  # one program; its best 2^d - 1 nodes, then all
    assert opts("dynamic:28:8x4", loop=device) == [(0, 0, 1), (1, 1, 1), (3, 2, 1), (7, 3, 1), (15, 4, 1), (28, 4, 1)]
    device = SimpleNamespace(shape=DynamicShape(10, 5, 31))
    assert opts("dynamic:31:10x5", loop=device)[-2:] == [(15, 4, 1), (31, 5, 1)]


def run_timed(ctrl: BudgetController, rows: int, steps: int, host_per_row: dict[bool, float],
              verify: float = 1e-3) -> list[int]:
    """``steps`` rounds of ``speculate`` + ``observe_step`` on a test-controlled clock: a verify costs
    ``verify`` seconds at every query bucket (a cheap GPU tree verify), the rest of the step
    ``host_per_row[speculative]`` seconds per row, and every even row accepts one draft token of a
    non-empty tree, odd rows none (1.5 tokens per row and step at batch 16, 2 at batch 1). Returns the budgets."""
    now = [0.0]

    class Drafter:
        budget = None

        def propose(self, reqs):
            return SimpleNamespace(trees=[SimpleNamespace(num_nodes=self.budget)] * len(reqs), draft_computed=None,
                                   device=None)

    class Verifier:
        def verify_proposal(self, reqs, proposal):
            now[0] += verify
            return [SimpleNamespace(accepted_nodes=[0] if t.num_nodes and i % 2 == 0 else [])
                    for i, t in enumerate(proposal.trees)]

    out = []
    with patch("specdec.adaptive.time.perf_counter", lambda: now[0]):
        for _ in range(steps):
            start = now[0]
            drafter = Drafter()
            ctrl.speculate([None] * rows, drafter, Verifier())
            now[0] += rows * host_per_row[drafter.budget > 0]
            ctrl.observe_step(now[0] - start)
            out.append(drafter.budget)
    return out


def test_measured_host_cost_of_speculative_steps_decides_the_budget():
    """Same verify cost at every tree size: with 60 us of host work per row in a speculative step against
    10 us in a plain one, speculation loses at batch 16 (1.5 tokens per 1.96 ms against 1 per 1.16 ms) and
    pays at batch 1 (2 tokens per 1.06 ms against 1 per 1.01 ms)."""
    host = {True: 60e-6, False: 10e-6}
    ctrl = BudgetController(CHAIN8, AdaptiveConfig(probe_interval=1000), cost_table=flat_table(base=1e-3))
    assert run_timed(ctrl, 16, 60, host)[-20:] == [0] * 20
    assert ctrl.costs.other[(16, True)] == pytest.approx(16 * 60e-6)
    assert ctrl.costs.other[(16, False)] == pytest.approx(16 * 10e-6)
    assert min(run_timed(ctrl, 1, 30, host)[-10:]) > 0
    # host work that does not depend on the kind of step: batch 16 speculates
    even = BudgetController(CHAIN8, AdaptiveConfig(probe_interval=1000), cost_table=flat_table(base=1e-3))
    assert min(run_timed(even, 16, 40, {True: 10e-6, False: 10e-6})[-10:]) > 0
    # a step that also finishes requests (their final detokenisation) moves the estimate by a clipped amount
    even.costs.observe_other(16, 1.0, True)
    assert even.costs.other[(16, True)] < 2 * 16 * 10e-6


def test_a_proposal_right_after_plain_steps_does_not_set_the_draft_cost():
    """An n-gram drafter indexes the tokens of budget-0 steps at its next proposal: that one is not the
    lookup's steady cost, so it is not learned; the proposals after it are."""
    ctrl = BudgetController(CHAIN8, AdaptiveConfig(probe_interval=1000), cost_table=flat_table())
    ctrl.last = ctrl.options[0]  # the previous step decoded plainly
    n = ctrl.choose(16)
    assert n > 0
    ctrl.observe(16, n + 1, [0] * 16, 5e-3, 1e-3)
    assert 16 not in ctrl.costs.draft
    n = ctrl.choose(16)
    ctrl.observe(16, n + 1, [0] * 16, 1e-4, 1e-3)
    assert ctrl.costs.draft[16] == pytest.approx(1e-4)


def test_fused_step_is_timed_as_its_draft_share_then_the_verify():
    """A device proposal (its draft program timed on the device, its verify launched by ``verify_proposal``) counts
    the program's share as drafting and the rest of ``propose`` plus ``verify_proposal`` as the verify."""
    now = [0.0]

    class Drafter:
        budget = None

        def propose(self, reqs):
            now[0] += 1.5e-3
            return SimpleNamespace(trees=[SimpleNamespace(num_nodes=self.budget)] * len(reqs), draft_computed=None,
                                   device=SimpleNamespace(draft_seconds=0.5e-3))

    class Verifier:
        def verify_proposal(self, reqs, proposal):
            now[0] += 0.1e-3
            return [SimpleNamespace(accepted_nodes=[]) for _ in reqs]

    ctrl = BudgetController(CHAIN8, AdaptiveConfig(probe_interval=1000), cost_table=flat_table(base=1e-3))
    with patch("specdec.adaptive.time.perf_counter", lambda: now[0]):
        ctrl.speculate([None], Drafter(), Verifier())
    assert list(ctrl.costs.seen.values()) == [pytest.approx(1.1e-3)]
