"""Pipelined fused EAGLE steps (``specdec/pipeline.py``, ``EagleAhead``): each fused step queues its successor,
built on the device from its outcome, before the host reads it; the next engine step adopts it.

The target is the 4-layer random Llama of ``test_eagle`` with a briefly trained EAGLE draft (it accepts
paths of several nodes, so the accepted KV really moves); on the CPU the padded graph steps run eagerly over
the same buffers (``cuda_graphs=True``).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from eagle_helpers import record_commits
from test_eagle import DEVICES, PROMPTS, setup, trained_pair  # noqa: F401 - setup: the trained tiny draft, a fixture
from test_fused_step import _host_inputs

from specdec.budget_policy import EpochBudget, EpochConfig, make_controller
from specdec.drafters.eagle_drafter import _Spans
from specdec.engine import SpecConfig, SpecEngine
from specdec.pipeline import QueuedStep
from specdec.sampling_params import SamplingParams
from specdec.step_inputs import StepInputs, _offsets

pytestmark = pytest.mark.usefixtures("single_thread")

CFG = dict(num_blocks=200, block_size=8, max_batch_size=4, cuda_graphs=True, adaptive=False, pipeline=True)
# rows that finish at different steps (the queued step then carries rows that are gone), one that stops at EOS
PARAMS = [SamplingParams(max_new_tokens=n, ignore_eos=i != 1) for i, n in enumerate((23, 9, 16, 30))]


@pytest.fixture(scope="module", params=DEVICES)
def tiny(setup, request):  # noqa: F811 - the fixture imported above
    return *trained_pair(setup, request.param, PARAMS), {**CFG, "device": request.param}


@pytest.mark.parametrize("tree", ["dynamic:16", "topk:2x3", "chain:4"])
def test_pipelined_steps_equal_target_only_and_the_unpipelined_steps(tiny, tree):
    """Greedy output equals target-only decoding, and every step's results (accepted nodes and tokens, bonus;
    features to rounding) and the engine's statistics equal the unpipelined fused steps', at batch 1 and 4 rows whose
    requests end at different steps (one at EOS); most steps are adopted from the queue, some with fewer rows
    than were queued; no KV block leaks."""
    draft, target, want, cfg = tiny
    runs = {}
    for pipeline in (True, False):
        eng = SpecEngine(draft, target, SpecConfig(tree=tree, **{**cfg, "pipeline": pipeline}))
        assert eng.drafter.pipelined == pipeline
        steps = runs.setdefault(pipeline, [])
        record_commits(eng, steps)
        outs = [[o.token_ids for o in eng.generate(PROMPTS[:1], PARAMS[:1])],
                [o.token_ids for o in eng.generate(PROMPTS[:4], PARAMS)]]
        assert outs == [want[:1], want]
        steps.append(eng.stats)
        paths = eng.drafter.paths
        if pipeline:
            assert paths["ahead"] >= paths["fused"] // 2 > 0, paths
        else:
            assert paths["ahead"] == 0
        assert eng.all_blocks_free()
    longest = max(len(r[0].accepted_nodes) for s in runs[True][:-1] for r in s)
    assert runs[True][-1].accepted > 0 and (longest >= 2 or tree == "chain:4")  # paths of 2+ nodes move KV
    # a queued step may still carry a finished row, so its batch (and a matmul's summation order) can differ:
    # the features agree to rounding, everything else exactly
    assert ([[r._replace(kv_moved=None) for r, _ in s] for s in runs[True][:-1]]
            == [[r._replace(kv_moved=None) for r, _ in s] for s in runs[False][:-1]])
    for a, b in zip(runs[True][:-1], runs[False][:-1]):
        for (_, fa), (_, fb) in zip(a, b):
            torch.testing.assert_close(torch.tensor(fa), torch.tensor(fb), rtol=1e-4, atol=1e-4)
    assert runs[True][-1] == runs[False][-1]


def test_queued_inputs_equal_the_host_built_ones(tiny, monkeypatch):
    """The inputs ``pipeline_hooks.advance`` and the tree writer build on the device for the queued step (the draft
    program's catch-up rows and target features, the verify's rows) equal, element by element, what the host
    builds for the same rows once the previous step is committed. The engine is warmed up first, on the CPU
    too (on CUDA it is at construction): the step queued behind the warm-up's last step is not left for the
    first real step to find."""
    draft, target, want, cfg = tiny
    eng = SpecEngine(draft, target, SpecConfig(tree="dynamic:16", **cfg))
    if not eng.plan.warm_up:
        eng.warm_up()
    d, loop = eng.drafter, eng.drafter.device_loop
    graphs = eng.runner.graphs
    queued = []
    fused = eng.verifier.fused
    relaunch = fused.relaunch

    def snapshot(key, r, out, n):  # the device inputs of the queued step, as its verify reads them
        res = relaunch(key, r, out, n)
        b, q = key[1], key[2]
        queued.append((key, graphs.inputs.dev[:_offsets(b, q, graphs.inputs.width)[1]].clone(),
                       loop.inputs.dev[:_offsets(b, loop.q, loop.inputs.width)[1]].clone(),
                       loop.features[:b * loop.q].clone()))
        return res

    monkeypatch.setattr(fused, "relaunch", snapshot)
    pipe, verify = eng.pipeline, eng.verifier.verify_proposal
    assert pipe.ahead is None
    propose, launched = pipe.propose, pipe.queued
    checked, pending = [], []

    def compare(rows):
        if pipe.ahead is None:
            return propose(rows)
        exact = [id(r) for r in rows] == [id(r) for r in pipe.ahead.rows]
        assert len(queued) == pipe.queued - launched  # a snapshot of every step queued since
        key, verify_in, program_in, program_feats = queued[-1]
        # the host's catch-up for the committed rows: what the unpipelined step would run now (its features read
        # from the slots the queued step's writer moved the accepted path's to)
        spans = _Spans.of(rows, loop.q)
        packed, bt, src = d._catch_up_rows(rows, spans, loop.q)
        host_feats = torch.stack([d.features.data[torch.from_numpy(row)] for row in src])  # (R, q, kH)
        prop = propose(rows)
        if not isinstance(prop.device, QueuedStep) or not exact:
            return prop
        b = key[1]
        ref = StepInputs(b, loop.q, loop.inputs.width, eng.runner.device)
        ref.fill_packed(b, loop.q, packed, bt)
        _assert_same_inputs(program_in, ref.dev[:program_in.numel()], b, loop.q, loop.inputs.width)
        feats = program_feats.view(b, loop.q, -1)
        assert torch.equal(feats[:len(rows)], host_feats.to(feats.dtype)) and not feats[len(rows):].any()
        pending.append((prop, key, verify_in))
        return prop

    def compare_verify(rows, prop):
        results = verify(rows, prop)  # (the adopted step's trees are known once it is read)
        if pending and pending[-1][0] is prop:
            _, key, verify_in = pending.pop()
            # (a queued step whose rows are a subset of the step before's stays in that step's bucket)
            got_key, ref_verify = _host_inputs(eng, rows, prop.trees, batch=key[1])
            assert got_key == key and len(rows) <= key[1]
            _assert_same_inputs(verify_in, ref_verify, key[1], key[2], graphs.inputs.width)
            checked.append(len(rows))
        return results

    monkeypatch.setattr(pipe, "propose", compare)
    monkeypatch.setattr(eng.verifier, "verify_proposal", compare_verify)
    outs = eng.generate(PROMPTS[:4], PARAMS)
    assert [o.error for o in outs] == [None] * 4
    assert [o.token_ids for o in outs] == want
    assert 4 in checked and len(checked) >= 3 and min(checked) < 4  # queued steps for all 4 rows and for fewer


def _assert_same_inputs(got: torch.Tensor, want: torch.Tensor, b: int, q: int, width: int) -> None:
    """Bucket (b, q)'s inputs equal, except block-table entries that were still empty when the queued step was
    built (the host's rows may have grown a block since, past anything the queued step writes or reads)."""
    o, n = _offsets(b, q, width)[0]["block_tables"]
    later = torch.zeros_like(got, dtype=torch.bool)
    later[o:o + n] = (got[o:o + n] == 0) & (want[o:o + n] != 0)
    assert torch.equal(got[~later], want[~later])


def test_pipeline_needs_a_fixed_budget_and_the_fused_step(tiny):
    """The pipeline runs when asked for (``pipeline`` True, or None on CUDA), with a fixed budget on the fused
    path: ``adaptive`` True turns it off, and None then means a fixed budget; its rows reserve one more path +
    bonus of KV; ``pipeline`` must be None or a bool."""
    draft, target, _, cfg = tiny
    cuda = cfg["device"] == "cuda"

    def engine(**fields):
        return SpecEngine(draft, target, SpecConfig(tree="topk:2x3", **{**cfg, **fields}))

    on, off, adaptive, unfused = engine(), engine(pipeline=False), engine(adaptive=True), engine(fused_verify=False)
    assert on.drafter.pipelined and on.adaptive is None and not off.drafter.pipelined
    assert not adaptive.drafter.pipelined and adaptive.adaptive is not None and not unfused.drafter.pipelined
    assert not adaptive.plan.budget_epochs and not on.plan.budget_epochs
    assert on.scheduler.lookahead == off.scheduler.lookahead + on.drafter.max_nodes + 1
    # the defaults: on CUDA pipelined, budgets held per batch bucket for epochs; on the CPU neither
    auto = engine(pipeline=None, adaptive=None)
    assert auto.drafter.pipelined is cuda and (auto.adaptive is not None) is cuda
    assert auto.plan.budget_epochs is cuda and isinstance(auto.adaptive, EpochBudget) is cuda
    assert engine(pipeline=True, adaptive=None).drafter.pipelined
    from specdec.cli.bench import engine_mode  # what ``specdec bench`` reports of it

    assert engine_mode(on) == {"pipelined": True, "adaptive_on": False, "budget_epochs": False,
                               "plan": on.plan.as_dict()}
    assert engine_mode(adaptive) == {"pipelined": False, "adaptive_on": True, "budget_epochs": False,
                                     "plan": adaptive.plan.as_dict()}
    assert (engine(pipeline=False, adaptive=None).adaptive is not None) is cuda  # adaptive as before
    from specdec.errors import FieldError

    with pytest.raises(FieldError, match="pipeline"):
        SpecConfig(pipeline="yes")


def test_pipelined_steps_hold_each_buckets_budget_for_epochs(tiny):
    """CUDA's default (``pipeline`` and ``adaptive`` None, set up here on the CPU): an ``EpochBudget`` holds one
    budget per (batch bucket, greedy or not) for epochs of steps, searching the budgets of the tree; greedy output
    equals target-only whatever it holds, sampled output is as long as asked, and queued steps are adopted within
    an epoch (a budget change drops the one queued step)."""
    draft, target, want, cfg = tiny
    eng = SpecEngine(draft, target, SpecConfig(tree="dynamic:16", **{**cfg, "adaptive": None}))
    eng.adaptive = ctrl = make_controller(True, eng.drafter, None, epochs=True)
    ctrl.config = EpochConfig(epoch_steps=2, epoch_rows=0, first_row_steps=0, hold_epochs=2, max_hold_epochs=2)
    eng.plan = dataclasses.replace(eng.plan, adaptive=True, budget_epochs=True)
    steps, propose = [], eng.drafter.propose
    eng.drafter.propose = lambda rows: steps.append((ctrl.key(rows), eng.drafter.node_budget)) or propose(rows)
    sampled = [SamplingParams(max_new_tokens=12, temperature=0.8, seed=5 + i, ignore_eos=True) for i in range(2)]
    for _ in range(3):
        assert [len(o.token_ids) for o in eng.generate(PROMPTS[:2], sampled)] == [12, 12]
        assert [o.token_ids for o in eng.generate(PROMPTS[:4], PARAMS)] == want
    nodes = {o.nodes for o in ctrl.options}
    assert len(nodes) > 2 and 0 in nodes and eng.drafter.max_nodes in nodes
    greedy4 = [n for key, n in steps if key == (4, True)]
    # the search measured the full tree and a smaller budget, and probes kept changing the budget
    changes = sum(a != b for a, b in zip(greedy4, greedy4[1:]))
    assert len(set(greedy4)) >= 2 and eng.drafter.max_nodes in greedy4 and changes >= 3
    assert {key[1] for key, _ in steps} == {True, False}
    assert eng.pipeline.adopted > 0 and eng.all_blocks_free()


def test_pipelined_engine_under_the_serving_executor(tiny):
    """Requests reaching a pipelined engine through the serving executor's loop thread while others run, one of
    them cancelled mid-stream: the others equal target-only, queued steps were adopted, and every block is freed."""
    from specdec.serving.executor import Executor

    draft, target, want, cfg = tiny
    ex = Executor(SpecEngine(draft, target, SpecConfig(tree="dynamic:16", **cfg)))
    try:
        long = ex.enqueue(PROMPTS[4], SamplingParams(max_new_tokens=200, ignore_eos=True))
        ids, seen = [], []
        for out in ex.stream(long, timeout=120):
            seen.append(out)
            if len(seen) <= 4:  # the others join a running batch, one per output of the long request
                ids.append(ex.enqueue(PROMPTS[len(ids)], PARAMS[len(ids)]))
            elif len(seen) == 12:
                ex.cancel(long)
        assert seen[-1].finish_reason == "abort" and len(seen[-1].token_ids) < 200
        assert [ex.result(i, timeout=120).token_ids for i in ids] == want
        assert ex.run_on_loop(lambda e: e.all_blocks_free() and e.drafter.paths["ahead"] > 0)
    finally:
        ex.shutdown()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel on the CPU needs the interpreter; "
                    "on CUDA the Triton backend's steps use it compiled")
def test_pipelined_steps_with_the_advance_kernel(tiny):
    """The queued steps' integer inputs from the one-launch ``kernels/advance.py`` (interpreted on the CPU; the
    rest of the step on the torch backend): greedy output equals target-only decoding, most steps queued."""
    from specdec.kernels.advance import advance_rows_triton

    draft, target, want, cfg = tiny
    eng = SpecEngine(draft, target, SpecConfig(tree="dynamic:16", **cfg))
    eng.pipeline.hook.rows_op = advance_rows_triton
    assert [o.token_ids for o in eng.generate(PROMPTS[:4], PARAMS)] == want
    assert eng.drafter.paths["ahead"] >= eng.drafter.paths["fused"] // 2 > 0


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_pipelined_steps_under_preemption(tiny, prefix_cache, count_preemptions):
    """A pool too small for every row at once: requests are preempted (their KV freed, recomputed later) while
    steps are queued for them; the queued steps of preempted rows are dropped and output equals target-only."""
    draft, target, want, cfg = tiny
    eng = SpecEngine(draft, target, SpecConfig(tree="dynamic:16", **{**cfg, "num_blocks": 34,
                                                                     "policy": "max_utilization",
                                                                     "prefix_cache": prefix_cache}))
    preempted = count_preemptions(eng)
    outs = eng.generate(PROMPTS[:4], PARAMS)
    assert preempted, "expected the small pool to force preemption"
    assert [o.token_ids for o in outs] == want and [o.error for o in outs] == [None] * 4
    assert eng.drafter.paths["ahead"] > 0 and eng.all_blocks_free()


def test_pipelined_steps_with_stop_strings_and_sampled_rows(tiny):
    """Rows that end at a stop string (inside an accepted path) and seeded sampled rows mixed with greedy ones
    (steps with sampled rows are queued too): outputs equal the
    unpipelined engine's, greedy rows equal target-only; a batch of sampled rows only is pipelined too."""
    draft, target, want, cfg = tiny
    tok = target.tokenizer
    stop = tok.decode(want[2][5:7], skip_special_tokens=True)  # text the third request writes early on
    params = [SamplingParams(max_new_tokens=23, ignore_eos=True),
              SamplingParams(max_new_tokens=20, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_new_tokens=16, ignore_eos=True, stop=[stop]),
              SamplingParams(max_new_tokens=30, ignore_eos=True)]
    outs = {}
    for pipeline in (True, False):
        eng = SpecEngine(draft, target, SpecConfig(tree="dynamic:16", **{**cfg, "pipeline": pipeline}))
        outs[pipeline] = [(o.token_ids, o.text, o.finish_reason) for o in eng.generate(PROMPTS[:4], params)]
        outs[pipeline, "greedy"] = [(o.token_ids, o.text) for o in eng.generate([PROMPTS[0], PROMPTS[2]],
                                                                                 [params[0], params[2]])]
        before = eng.drafter.paths["ahead"]
        sampled = [SamplingParams(max_new_tokens=n, temperature=t, top_p=p, seed=s, ignore_eos=True)
                   for n, t, p, s in ((18, 0.7, 0.9, 1), (9, 1.0, 1.0, 2), (14, 1.3, 0.8, 3))]
        outs[pipeline, "sampled"] = [o.token_ids for o in eng.generate(PROMPTS[1:4], sampled)]
        outs[pipeline, "alone"] = [o.token_ids for o in eng.generate([PROMPTS[1]], sampled[0])]
        assert eng.all_blocks_free() and (eng.drafter.paths["ahead"] > before > 0) == pipeline
    assert outs[True] == outs[False]
    assert outs[True][2][2] == "stop" and stop not in outs[True][2][1] and len(outs[True][2][0]) < 16
    assert outs[True][0][0] == want[0] and outs[True][3][0] == want[3]
    assert outs[True, "greedy"] == outs[False, "greedy"]
    assert outs[True, "sampled"] == outs[False, "sampled"] and outs[True, "alone"] == outs[False, "alone"]
    assert outs[True, "alone"][0] == outs[True, "sampled"][0]  # seeded: the same alone and in a batch


@pytest.mark.parametrize("tree", ["dynamic:16", "topk:2x3"])
def test_advance_graph_path_with_a_stand_in_graph(tiny, monkeypatch, tree):
    """``AdvanceGraphs``' CUDA path (the EAGLE hook's) run with a stand-in graph (capturing runs the build once, as
    the real capture does, and each replay runs it again over the graph's own input copies): capturing over a no-op
    outcome and putting the verify rows back leaves every step as the eager one, so output equals target-only; one
    graph per bucket and tree shape, replayed at the later queued steps, also for fewer live rows than its bucket
    (3 of 4: the padding row left alone); a static tree's entry keeps the node offsets its graph reads."""
    import specdec.graphs as cg
    from specdec.pipeline import AdvanceGraphs

    class StandIn:
        def __init__(self, build):
            self.build, self.replays = build, 0

        def replay(self):
            self.replays += 1
            self.build()

    def stand_in(build, pool, device):
        build()  # the real capture_graph runs the forward once before capturing it
        return StandIn(build), None

    monkeypatch.setattr(cg, "capture_graph", stand_in)
    draft, target, want, cfg = tiny
    if cfg["device"] != "cpu":
        pytest.skip("a stand-in for the CUDA graph; on CUDA the real graphs run in the other tests")
    eng = SpecEngine(draft, target, SpecConfig(tree=tree, **cfg))
    eng.pipeline.hook.advance = graphs = AdvanceGraphs(eng.runner.device, capture=True)
    monkeypatch.setattr(eng.runner.graphs, "captured", lambda key: True)  # as on CUDA (the forwards stay eager)
    assert [o.token_ids for o in eng.generate(PROMPTS[:4], PARAMS)] == want
    assert graphs.graphs and sum(g.replays for g, *_ in graphs.graphs.values()) >= eng.drafter.paths["ahead"] > 0
    ahead, replays = eng.drafter.paths["ahead"], sum(g.replays for g, *_ in graphs.graphs.values())
    assert [o.token_ids for o in eng.generate(PROMPTS[:3], PARAMS[:3])] == want[:3]  # 3 live rows of bucket 4
    assert eng.drafter.paths["ahead"] > ahead and sum(g.replays for g, *_ in graphs.graphs.values()) > replays

    def offsets(build):  # the node offsets the entry's builder (what its graph was captured from) holds
        return dict(zip(build.__code__.co_freevars, (c.cell_contents for c in build.__closure__)))["offsets"]

    assert all((offsets(entry[2]) is not None) == tree.startswith("topk") for entry in graphs.graphs.values())



@pytest.mark.parametrize("pipeline", [False, True])
def test_budget_0_steps_leave_the_draft_behind_and_it_catches_up(tiny, pipeline):
    """At budget 0 the draft does not run (the step is plain decoding: empty trees; pipelined, queued as target-only
    decoding's) and falls behind; the next step that speculates catches it up over every position it missed, from
    the features kept in their slots (the positions before the pending token in one forward, then the device
    program); greedy output equals target-only decoding, no KV block leaks, and drafts after a catch-up are
    accepted as often as those of a draft that never fell behind (its KV is the same: the target's greedy
    tokens do not depend on the draft, so equal acceptance is a check on the draft's state)."""
    draft, target, want, cfg = tiny
    rates = []
    for schedule in ((None,), (None,) + (0,) * 12 + (None, None)):
        eng = SpecEngine(draft, target, SpecConfig(tree="dynamic:16", **{**cfg, "pipeline": pipeline}))
        count, lag, propose, step = [0], [], eng.drafter.propose, eng.step

        def spy(rows, propose=propose, lag=lag):
            lag.append(max(len(r.tokens) - r.num_computed_draft for r in rows))
            return propose(rows)

        def stepped(step=step, count=count, eng=eng, schedule=schedule):
            eng.drafter.budget = schedule[count[0] % len(schedule)]
            count[0] += 1
            return step()

        eng.drafter.propose, eng.step = spy, stepped
        assert [o.token_ids for o in eng.generate(PROMPTS[:4], PARAMS)] == want
        assert eng.all_blocks_free()
        paths = eng.drafter.paths
        if len(schedule) > 1:
            assert paths["decode"] > 0 and paths["behind"] > 0 and max(lag) > 5, (paths, max(lag))
        else:
            assert paths["decode"] == paths["behind"] == 0
        rates.append(eng.stats.accepted / eng.stats.drafted)
    assert rates[1] >= 0.85 * rates[0] > 0, rates


@pytest.mark.parametrize("proposer", ["eagle", "eagle0", "none", "ngram", "ngram0"])
def test_rows_whose_prefill_ends_join_the_queued_step(tiny, proposer):
    """Two rows for four requests that end at different steps: each request after the first two is prefilled while
    the others decode, and joins the step queued behind that step's verify (``StepPipeline.queue``'s joining rows)
    instead of waiting for an unqueued step. Greedy output equals target-only decoding and the unpipelined engine's;
    with seeded sampled rows mixed in, every row equals the unpipelined engine's; rows really joined; no KV block
    leaks. EAGLE's fused steps and its decode steps at budget 0 (``eagle0``, whose draft does not run; its sampled
    run speculates again), target-only decoding (``ChainAhead`` of no chain), and the n-gram drafter's chain steps
    (a joining row's first chain looked up on the host, its history sent to the device as it joins) and its decode
    steps held at budget 0 (``ngram0``)."""
    draft, target, want, cfg = tiny
    draft = {"eagle": draft, "eagle0": draft, "none": None, "ngram": "ngram", "ngram0": "ngram"}[proposer]
    cfg = {**cfg, "max_batch_size": 2, "admit_min_free": 1}
    sampled = [p if i % 2 == 0 else dataclasses.replace(p, temperature=0.8, top_p=0.9, seed=11 + i)
               for i, p in enumerate(PARAMS)]
    outs = {}
    for pipeline in (True, False):
        tree = "chain:4" if proposer.startswith("ngram") else "dynamic:16"
        extra = {"ngram_device": True} if proposer.startswith("ngram") else {}
        eng = SpecEngine(draft, target, SpecConfig(tree=tree, **{**cfg, "pipeline": pipeline, **extra}))
        if proposer in ("ngram0", "eagle0"):
            eng.drafter.budget = 0
        outs[pipeline] = [o.token_ids for o in eng.generate(PROMPTS[:4], PARAMS)]
        joined = eng.pipeline.joined if pipeline else 0
        if proposer == "eagle0":
            eng.drafter.budget = None
        outs[pipeline, "sampled"] = [o.token_ids for o in eng.generate(PROMPTS[:4], sampled)]
        if pipeline:
            assert joined >= 1 and eng.pipeline.joined > joined, (joined, eng.pipeline.joined)
        assert eng.all_blocks_free()
    assert outs[True] == outs[False] == want
    assert outs[True, "sampled"] == outs[False, "sampled"] != outs[True]
