"""Fused greedy EAGLE steps (``specdec/fused_step.py``): the drafter proposes the device program's trees on the
device and the verifier launches the verify forward right behind the program, its inputs built on the device from
the program's output.

The target is the 4-layer random Llama of ``test_eagle`` with a briefly trained EAGLE draft; on the CPU the
padded graph steps run eagerly over the same buffers (``cuda_graphs=True``). One test uses the shipped
``smollm2-135m-draft`` with SmolLM2-135M.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from eagle_helpers import record_commits
from test_eagle import PROMPTS, setup  # noqa: F401 - the module's trained tiny draft, a fixture

from specdec.drafters.eagle_device import DeviceDraftProgram
from specdec.drafters.eagle_drafter import best_nodes
from specdec.engine import SpecConfig, SpecEngine
from specdec.graphs import GraphRunner
from specdec.loading.registry import load_model
from specdec.sampling_params import SamplingParams
from specdec.step_inputs import StepInputs, _offsets
from specdec.tree import depths_and_masks
from specdec.tree_writer import ancestry, best_nodes_on_device, kept_ranks
from specdec.verifier import VerifyResult, _packed

pytestmark = pytest.mark.usefixtures("single_thread")

PARAMS = SamplingParams(max_new_tokens=16, ignore_eos=True)
CFG = dict(num_blocks=160, block_size=8)


@pytest.fixture(scope="module")
def tiny(setup):  # noqa: F811 - the fixture imported above
    root, _, target = setup
    draft = load_model(root / "full", target=target)
    plain = SpecEngine(None, target, SpecConfig(**CFG)).generate(PROMPTS, PARAMS)
    return draft, target, [o.token_ids for o in plain]


def _engine(draft, target, tree: str, **cfg) -> SpecEngine:
    return SpecEngine(draft, target, SpecConfig(tree=tree, max_batch_size=4, cuda_graphs=True,
                                                **{"adaptive": False, "pipeline": False, **CFG, **cfg}))


def _host_inputs(eng: SpecEngine, rows, trees, batch: int | None = None) -> tuple[tuple, torch.Tensor]:
    """The verify bucket and its device inputs as the unfused path fills them for ``trees`` (``batch``: in a bucket
    of that many rows instead of the smallest that holds them)."""
    graphs, runner = eng.runner.graphs, eng.runner
    lengths = [t.num_nodes + 1 for t in trees]
    key = runner.packed_key(0, len(rows), max(lengths), graphs.aux_layers)
    if batch is not None:
        key = (key[0], batch, key[2])
    ref = StepInputs(key[1], key[2], graphs.inputs.width, runner.device)
    bt = runner.tables.host_rows([r.bt_row for r in rows])
    ref.fill_packed(key[1], key[2], _packed(rows, trees, lengths, key[2], bt, runner.pool.block_size), bt)
    return key, ref.dev[:_offsets(key[1], key[2], graphs.inputs.width)[1]]


@pytest.mark.parametrize("tree", ["dynamic:16", "dynamic:12:3x5", "topk:2x3", "chain:4"])
def test_fused_greedy_equals_target_only_with_host_built_inputs(tiny, tree, monkeypatch):
    """Every greedy step takes the fused path, at batch 1 and 3 rows padded to a bucket of 4, with the full
    tree and adaptive budgets below N (5 or N - 2); the verify inputs it builds on the device equal, element by
    element, those the host path packs for the same trees; at budget 0 the draft does not run (empty trees, plain
    decoding) and catches up when the next budget speculates; the output equals target-only."""
    draft, target, want = tiny
    eng = _engine(draft, target, tree)
    checked = _check_fused_inputs(eng, want, monkeypatch, (None, min(5, eng.verifier.fused.nodes - 2), 0))
    assert {1, 3} <= set(checked)
    assert eng.stats.accepted > 0


def _check_fused_inputs(eng: SpecEngine, want, monkeypatch, budgets) -> list[int]:
    """Generate at batch 1 and 3 (padded to 4) under each budget, every greedy step fused: its verify inputs
    equal those the host path packs for the proposal's trees and the output equals target-only (``want``).
    Returns the rows of each checked step."""
    seen, forward = {}, GraphRunner._forward

    def snapshot(self, key):
        if key[0] == 0:
            seen["verify"] = (key, self.inputs.dev.clone())
        return forward(self, key)

    monkeypatch.setattr(GraphRunner, "_forward", snapshot)
    if eng.runner.graphs.graphs:  # captured verify graphs replay without calling _forward
        monkeypatch.setattr(eng.runner.graphs, "graphs", {})
    checked, decoded, verify = [], [], eng.verifier.verify_proposal

    def compare(rows, prop):
        if eng.drafter.node_budget == 0:  # plain decoding: no draft, no device trees
            assert prop.device is None and all(t.num_nodes == 0 for t in prop.trees)
            decoded.append(len(rows))
            return verify(rows, prop)
        assert prop.device is not None  # the trees are on the device: the verifier launches their verify
        results = verify(rows, prop)
        key, ref = _host_inputs(eng, rows, prop.trees)
        got_key, got = seen.pop("verify")
        assert got_key == key and torch.equal(got[:ref.numel()], ref)
        checked.append(len(rows))
        return results

    monkeypatch.setattr(eng.verifier, "verify_proposal", compare)
    before, steps_before = dict(eng.drafter.paths), eng.verifier.fused.steps  # (CUDA: the warm-up's steps)
    for budget in budgets:
        eng.drafter.budget = budget
        for prompts in ([PROMPTS[0]], PROMPTS[1:4]):
            got = eng.generate(prompts, PARAMS)
            assert [o.token_ids for o in got] == [want[PROMPTS.index(p)] for p in prompts]
            assert eng.all_blocks_free()
    paths = {k: eng.drafter.paths[k] - before.get(k, 0) for k in ("fused", "device", "host", "decode")}
    assert paths["fused"] == paths["device"] == len(checked) == eng.verifier.fused.steps - steps_before
    assert paths["host"] == 0 and paths["decode"] == len(decoded) and (len(decoded) > 0) == (0 in budgets)
    return checked


def _captured_vs_eager(draft, target, want, monkeypatch, **cfg) -> dict:
    """Dynamic trees with ``TreeWriter`` capturing graphs, then building eagerly: in both, every step's verify
    inputs equal the host-packed ones and the output equals target-only; the proposals' trees are the same
    (a stale graph input would still give target-only's output: its trees are what the verify checked).
    Returns the capturing run's writer and its fused steps."""
    trees, writers, steps = {}, {}, {}
    for capture in (True, False):
        eng = _engine(draft, target, "dynamic:16", **cfg)
        writer = writers[capture] = eng.verifier.fused.writer
        writer.capture = capture
        if not capture:
            writer.graphs.clear()  # the engine captured some at start (``FusedVerify.prepare``)
        seen, verify = trees.setdefault(capture, []), eng.verifier.verify_proposal

        def spy(rows, prop, verify=verify, seen=seen):  # (a device proposal's trees are known once verified)
            results = verify(rows, prop)
            if prop.device is not None:  # (budget 0: no draft, no trees)
                seen.append([(t.host.tokens, t.host.parents) for t in prop.trees])
            return results

        eng.verifier.verify_proposal = spy
        with monkeypatch.context() as m:
            steps[capture] = len(_check_fused_inputs(eng, want, m, (None, 5, 0)))
        assert bool(writer.graphs) == capture
    assert trees[True] == trees[False] and len(trees[True]) == steps[True] > 0
    return writers[True], steps[True]


class _StandInGraph:
    """A CUDA graph's stand-in on the CPU: ``replay`` re-runs the captured building into the captured outputs."""

    def __init__(self, build, outs):
        self.build, self.outs, self.replays = build, outs, 0

    def replay(self):
        self.replays += 1
        for dst, src in zip(self.outs, self.build()):
            dst.copy_(src)


def _stand_in_capture(monkeypatch) -> list:
    """Make ``capture_graph`` return ``_StandInGraph``s; the returned list collects each capture's outputs."""
    import specdec.graphs as cg

    captured = []

    def stand_in(build, pool, device):
        outs = tuple(t.clone() for t in build())  # a graph's outputs are buffers of its own
        captured.append(outs)
        return _StandInGraph(build, outs), outs

    monkeypatch.setattr(cg, "capture_graph", stand_in)
    return captured


def test_tree_writer_replay_path_with_a_stand_in_graph(tiny, monkeypatch):
    """``TreeWriter``'s CUDA path (a graph per bucket and budget, replayed over a copy of the program's output
    into the first rows of its input) run with a stand-in graph that re-runs the captured building into the
    captured outputs gives the eager building's trees and verify inputs (``_captured_vs_eager``), rows short of
    their bucket (3 rows of 4) included: every step that keeps nodes replays a graph."""
    _stand_in_capture(monkeypatch)
    draft, target, want = tiny
    assert not _engine(draft, target, "dynamic:16").verifier.fused.writer.capture  # on the CPU: eager
    writer, steps = _captured_vs_eager(draft, target, want, monkeypatch)
    keys = {(b, n) for b, _, n in writer.graphs}
    assert keys >= {(1, 5), (1, 16), (4, 5), (4, 16)}
    assert all(n for _, n in keys)  # budget 0 keeps no nodes: nothing to write, no graph
    assert sum(entry[0].replays for entry in writer.graphs.values()) == steps


def test_tree_writer_graphs_are_captured_at_start(tiny, monkeypatch):
    """``FusedVerify.prepare`` (the engine calls it at start on CUDA) captures one tree-building graph per full
    batch bucket and budget, so the steps that follow replay them and capture none (with ``_StandInGraph``)."""
    captured = _stand_in_capture(monkeypatch)
    draft, target, want = tiny
    eng = _engine(draft, target, "dynamic:16")
    fused = eng.verifier.fused
    assert fused.prepare([16]) == 0  # the CPU writer builds eagerly: nothing to capture
    fused.writer.capture = True
    buckets = eng.runner.graphs.batch_buckets
    assert fused.prepare([0, 5, 16, 16]) == 2 * len(buckets)  # (budget 0 writes no tree: no graph)
    assert set(fused.writer.graphs) == {(b, fused.key(b, min(n, 16))[2], n) for b in buckets for n in (5, 16)}
    assert fused.prepare([5]) == 0  # already there
    eng.drafter.budget = 5
    done = len(captured)
    assert [o.token_ids for o in eng.generate([PROMPTS[0]], PARAMS)] == want[:1]
    assert len(captured) == done and eng.drafter.paths["fused"] > 0


@pytest.mark.parametrize("tree", ["dynamic:16", "topk:2x3"])
def test_adaptive_budget_takes_the_fused_path(tiny, tree):
    """With the adaptive controller choosing budgets, greedy steps are fused and output equals target-only."""
    draft, target, want = tiny
    eng = _engine(draft, target, tree, adaptive=True)
    assert eng.adaptive is not None
    assert [o.token_ids for o in eng.generate(PROMPTS[:3], PARAMS)] == want[:3]
    assert eng.drafter.paths["fused"] == eng.drafter.paths["device"] > 0 and eng.all_blocks_free()


READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.mark.parametrize("fused", [True, False])
def test_no_host_read_between_the_draft_program_and_the_verify(tiny, fused, monkeypatch):
    """Between the end of the draft program and the start of the verify forward a fused step reads nothing
    from a tensor (the unfused path reads the trees there: the count is not blind); the trees and the
    acceptance come back in one read."""
    draft, target, want = tiny
    events = []
    for name in READS:
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _m=method, _n=name: events.append(_n) or _m(self, *a))
    run, forward = DeviceDraftProgram.run, GraphRunner._forward

    def program(self, *args):
        out = run(self, *args)
        events.append("draft")
        return out

    def verify(self, key):
        if key[0] == 0:
            events.append("verify")
        return forward(self, key)

    monkeypatch.setattr(DeviceDraftProgram, "run", program)
    monkeypatch.setattr(GraphRunner, "_forward", verify)
    eng = _engine(draft, target, "dynamic:16", fused_verify=fused)
    eng.drafter.budget = 7
    assert [o.token_ids for o in eng.generate(PROMPTS[:3], PARAMS)] == want[:3]
    between, steps, i = [], 0, 0
    while "draft" in events[i:]:
        i = events.index("draft", i) + 1
        steps += 1
        between.append(events[i:events.index("verify", i)])
    assert steps == eng.drafter.paths["device"] > 0
    if fused:
        assert all(b == [] for b in between) and eng.drafter.paths["fused"] == steps
    else:
        assert all(len(b) > 0 for b in between) and eng.verifier.fused is None


def test_device_best_nodes_and_ancestry_equal_the_host_trees():
    """``best_nodes_on_device`` + ``ancestry`` equal ``best_nodes`` and the host depths/masks, including nodes
    whose parent falls outside the budget (re-rooted) and deep chains (bit 62 of the masks); ``kept_ranks`` are the
    kept nodes' ranks, so a smaller budget's nodes are the larger one's below it."""
    g = torch.Generator().manual_seed(0)
    rows, m = 6, 63
    parents = [[-1] + [int(torch.randint(0, i, (1,), generator=g)) if i % 7 else -1 for i in range(1, m)]
               for _ in range(rows - 1)] + [[-1] + list(range(m - 1))]  # the last row: one chain of 63
    ranks = [torch.randperm(m, generator=g).tolist() for _ in range(rows)]
    tokens = torch.randint(0, 1000, (rows, m), generator=g)
    out = torch.stack([tokens, torch.tensor(parents), torch.tensor(ranks)], 1)  # (R, 3, N)
    for n in (0, 1, 17, m):
        tok, par, _ = best_nodes_on_device(out, n)
        depth, anc = ancestry(par, m)
        for i in range(rows):
            tree = best_nodes(tokens[i].tolist(), parents[i], ranks[i], n)
            assert tok[i].tolist() == tree.host.tokens and par[i].tolist() == tree.host.parents
            d, masks = depths_and_masks(tree.host.parents)
            assert depth[i].tolist() == d and anc[i].tolist() == masks
        # each kept node's score rank, in the same order: a smaller budget keeps exactly those below it
        kept = kept_ranks(out, n)
        assert kept.tolist() == [[r[j] for j in range(m) if r[j] < n] for r in ranks]
        for j in (0, 1, 5, 17):
            if j <= n:
                assert [[t for t, r in zip(tok[i].tolist(), kept[i].tolist()) if r < j] for i in range(rows)] \
                    == best_nodes_on_device(out, j)[0].tolist()
    assert int(ancestry(torch.tensor([parents[-1]]), m)[1][0, -1]) == (1 << 63) - 1  # bits 0..62


def test_shipped_draft_fused_equals_target_only(smollm2):
    """The shipped ``smollm2-135m-draft`` over SmolLM2-135M, float32: a dynamic tree cut to an adaptive budget
    below N, at batch 1 and 3 rows in a bucket of 4, fused every step, equal to target-only."""
    from specdec.loading.default_draft import default_draft_available

    if not default_draft_available():
        pytest.skip("the shipped draft is not installed")
    draft = load_model("smollm2-135m-draft", target=smollm2)
    prompts = [[{"role": "user", "content": q}] for q in ("Name a color.", "What is 2 + 2?", "Say hi.")]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    cfg = dict(num_blocks=96, block_size=16)
    want = [o.token_ids for o in SpecEngine(None, smollm2, SpecConfig(**cfg)).generate(prompts, params)]
    eng = _engine(draft, smollm2, "dynamic:31", **cfg)
    eng.drafter.budget = 7
    assert eng.verifier.fused.nodes == 31
    assert [o.token_ids for o in eng.generate(prompts[:1], params)] == want[:1]
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert eng.drafter.paths["fused"] == eng.drafter.paths["device"] > 0 and eng.stats.accepted > 0
    assert eng.all_blocks_free()


def test_the_verify_may_overwrite_the_draft_programs_output(tiny, monkeypatch):
    """On CUDA the program's output and the verify graph's intermediates share one memory pool: a fused step
    must not read the program's output buffer after the verify ran (here the verify clobbers it)."""
    draft, target, want = tiny
    last, run, forward = [], DeviceDraftProgram.run, GraphRunner._forward

    def program(self, *args):
        last[:] = [run(self, *args)]
        return last[0]

    def clobbering(self, key):
        if key[0] == 0 and last:
            with torch.inference_mode():
                last[0].fill_(-7)
        return forward(self, key)

    monkeypatch.setattr(DeviceDraftProgram, "run", program)
    monkeypatch.setattr(GraphRunner, "_forward", clobbering)
    for tree in ("dynamic:16", "topk:2x3"):
        eng = _engine(draft, target, tree)
        eng.drafter.budget = 5
        assert [o.token_ids for o in eng.generate(PROMPTS[:3], PARAMS)] == want[:3]
        assert eng.drafter.paths["fused"] > 0 and eng.all_blocks_free()


def _on_gpu(made):
    """``setup``'s target and full draft on the GPU, the engine config there, and target-only's eager output."""
    root, _, _ = made
    target = load_model(root / "target", device="cuda")
    draft = load_model(root / "full", target=target, device="cuda")
    cfg = dict(CFG, device="cuda")
    want = [o.token_ids for o in SpecEngine(None, target, SpecConfig(cuda_graphs=False, **cfg)).generate(
        PROMPTS, PARAMS)]
    return target, draft, cfg, want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_captured_tree_building_equals_the_eager_one(setup, monkeypatch):  # noqa: F811 - the fixture
    """float32 on the GPU, dynamic trees: the verify inputs built by ``TreeWriter``'s captured graphs (one per
    bucket and budget; the writer's default on CUDA) and by the eager building both equal the host-packed
    ones, the trees are the same and the output equals target-only (``_captured_vs_eager``)."""
    target, draft, cfg, want = _on_gpu(setup)
    started = _engine(draft, target, "dynamic:16", **cfg)
    writer = started.verifier.fused.writer
    assert writer.capture and {(b, n) for b, _, n in writer.graphs} >= {
        (b, 16) for b in started.runner.graphs.batch_buckets}  # captured at start (``FusedVerify.prepare``)
    writer, _ = _captured_vs_eager(draft, target, want, monkeypatch, **cfg)
    assert len(writer.graphs) >= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tree", ["dynamic:16", "topk:2x3"])
def test_gpu_fused_step_with_captured_graphs(setup, tree):  # noqa: F811 - the fixture imported above
    """float32 on the GPU, draft program and verify captured: fused steps (budgets N and 5, batch 1 and 3 rows
    in a bucket of 4) give target-only's output and the unfused path's trees."""
    target, draft, cfg, want = _on_gpu(setup)
    trees = {}
    for fused in (True, False):
        eng = _engine(draft, target, tree, fused_verify=fused, **cfg)
        assert len(eng.drafter.device_loop.graphs) > 0 and eng.graph_report.graphs > 0
        seen, verify = trees.setdefault(fused, []), eng.verifier.verify_proposal

        def spy(rows, prop, verify=verify, seen=seen):  # (a device proposal's trees are known once verified)
            results = verify(rows, prop)
            seen.append([t.host.tokens for t in prop.trees])
            return results

        eng.verifier.verify_proposal = spy
        for budget in (None, 5):
            eng.drafter.budget = budget
            for prompts in ([PROMPTS[0]], PROMPTS[1:4]):
                got = eng.generate(prompts, PARAMS)
                assert [o.token_ids for o in got] == [want[PROMPTS.index(p)] for p in prompts]
        assert (eng.drafter.paths["fused"] == eng.drafter.paths["device"] > 0) == fused
        assert eng.all_blocks_free()
    assert trees[True] == trees[False]


@pytest.mark.parametrize("tree", ["dynamic:16", "topk:2x3"])
def test_fused_results_and_stats_equal_the_unfused_ones(tiny, tree):
    """The fused step builds its results from the read arrays, without trees: step by step they equal the
    unfused path's (accepted nodes and tokens, bonus, nodes drafted, tree depth, features), and so do the
    engine's acceptance statistics (depth counts included) and the trees ``propose`` returns, at batch 1 and 3
    rows padded to a bucket of 4, with the program's N and budgets below it (5 and 0)."""
    draft, target, want = tiny
    runs = {}
    for fused in (True, False):
        eng = _engine(draft, target, tree, fused_verify=fused)
        steps, trees = runs.setdefault(fused, ([], []))
        verify = eng.verifier.verify_proposal

        def spy_verify(rows, proposal, verify=verify, trees=trees):
            results = verify(rows, proposal)  # (a device proposal's trees are known once verified)
            trees.append([(t.host.tokens, t.host.parents, t.num_nodes, t.max_depth) for t in proposal.trees])
            return results

        record_commits(eng, steps)

        eng.verifier.verify_proposal = spy_verify
        outputs = []
        for budget in (None, 5, 0):
            eng.drafter.budget = budget
            for prompts in ([PROMPTS[0]], PROMPTS[1:4]):
                outputs.append([o.token_ids for o in eng.generate(prompts, PARAMS)])
        assert (eng.drafter.paths["fused"] == eng.drafter.paths["device"] > 0) == fused
        steps.append(eng.stats)
        trees.append(outputs)
    assert runs[True][0][-1].accepted > 0 and runs[True][0][-1].depth_accepted
    fused = [r for step in runs[True][0][:-1] for r, _ in step]
    if tree.startswith("dynamic"):  # a dynamic tree's accepted nodes come with their score ranks, rising along a path
        ranked = [r.ranks for r in fused if r.num_drafted]  # (steps at budget 0 draft nothing)
        assert any(ranked) and all(rk is not None and rk == sorted(set(rk)) for rk in ranked)
    else:  # a static template's budgets keep its first nodes: the nodes' indices are their ranks
        assert all(r.ranks is None for r in fused)
    assert _no_ranks(runs[True]) == _no_ranks(runs[False])  # (the unfused path reads no ranks)
    assert runs[True][1][-1][:2] == [[want[0]], want[1:4]]


def _no_ranks(x):
    """``x`` with every ``VerifyResult``'s ranks left out (lists and tuples walked)."""
    if isinstance(x, VerifyResult):
        return x._replace(ranks=None)
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_no_ranks(v) for v in x)
    return x


def test_fused_tree_depths_and_lazy_trees():
    """The device depths (``ancestry`` then ``tree_top``, what the tree writer hands the read) equal
    ``DraftTree.max_depth`` of random topologically ordered trees (0 for trees without nodes); ``FusedTrees``
    builds the same trees as ``DraftTree.of_parents``, on demand."""
    from specdec.fused_step import FusedTrees
    from specdec.tree import DraftTree
    from specdec.tree_writer import shape_depth, tree_top

    rng = np.random.default_rng(3)
    for n in (0, 1, 5, 31):
        parents = np.array([[rng.integers(-1, j) for j in range(n)] for _ in range(6)], dtype=np.int64).reshape(6, n)
        tokens = rng.integers(0, 100, (6, n))
        want = [DraftTree.of_parents(t.tolist(), p.tolist()) for t, p in zip(tokens, parents)]
        depth = ancestry(torch.from_numpy(parents), 32)[0] if n else None
        assert tree_top(depth, 6, "cpu").flatten().tolist() == [t.max_depth for t in want]
        lazy = FusedTrees(tokens, parents)
        assert len(lazy) == 6 and lazy.num_nodes == n and not lazy._trees
        assert [(t.host.tokens, t.host.parents) for t in lazy] == [(t.host.tokens, t.host.parents) for t in want]
        assert lazy[-1] is lazy[5]
        if n:
            assert shape_depth(tuple(parents[0].tolist())) == want[0].max_depth
    assert shape_depth(()) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tree", ["dynamic:16", "topk:2x3"])
def test_gpu_captured_graphs_outlive_their_constant_caches(setup, tree):  # noqa: F811 - the fixture
    """float32 on the GPU, pipelined: the captured tree-building and ``advance`` graphs read cached constants
    (``ancestry``'s start masks where the tree writer runs its torch ops, the catch-up's causal masks, a static
    tree's node offsets). After more other shapes than each cache holds, with every evicted entry's memory then
    refilled with garbage, the output still equals target-only (``specdec.graphs.graph_constant`` keeps what a
    capture read; ``AdvanceGraphs`` keeps the offsets it was captured with)."""
    from specdec.lookahead_ops import causal_masks
    from specdec.pipeline_hooks import node_offsets
    from specdec.tree_writer import _ancestry_start

    target, draft, cfg, want = _on_gpu(setup)
    eng = _engine(draft, target, tree, pipeline=True, **cfg)
    assert eng.drafter.pipelined
    assert [o.token_ids for o in eng.generate(PROMPTS, PARAMS)] == want  # every graph captured by now
    assert eng.drafter.paths["ahead"] > 0
    dev = torch.device("cuda", torch.cuda.current_device())
    # what the captured graphs hold: the tree writer's start masks (its torch ops; the Triton kernel that replaces
    # them on CUDA reads no constant), or the offsets in AdvanceGraphs' entries
    if tree.startswith("dynamic"):
        held = [True] if eng.verifier.fused.writer.use_triton else _ancestry_start.held
    else:
        held = [entry[2] for entry in eng.pipeline.hook.advance.graphs.values()]  # (each entry keeps its builder)
    assert held and causal_masks.held
    junk = []
    for i in range(80):  # 80 (R, n) shapes for a cache of 64, 64 query counts for 16, 40 chains for 32
        made = [*_ancestry_start(1 + i // 10, 1 + i % 10, dev), causal_masks(1 + i % 64, dev),
                node_offsets(tuple(range(-1, i % 40)), dev)]
        junk += [torch.full_like(t, (1 << 40) + 7) for t in made for _ in range(3)]
    del made
    junk += [torch.full_like(t, (1 << 40) + 7) for t in junk[:200]]  # what the evictions freed, refilled
    assert [o.token_ids for o in eng.generate(PROMPTS, PARAMS)] == want
    assert eng.drafter.paths["ahead"] > 0 and eng.all_blocks_free()


def _mixed_params() -> list[SamplingParams]:
    """Seeded sampled rows (with and without top-p) beside greedy ones."""
    return [SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.8, seed=3),
            PARAMS,
            SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=1.0, top_p=0.9, seed=4),
            SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.6, top_k=5, seed=5)]


def _fused_vs_unfused_sampled(draft, target, tree: str, want, **cfg) -> None:
    outs = {}
    for fused in (True, False):
        eng = _engine(draft, target, tree, fused_verify=fused, **cfg)
        got = []
        for budget in (None, 5):
            eng.drafter.budget = budget
            got.append([o.token_ids for o in eng.generate(PROMPTS[:4], _mixed_params())])
            got.append([o.token_ids for o in eng.generate([PROMPTS[2]], _mixed_params()[2])])
        assert (eng.drafter.paths["fused"] == eng.drafter.paths["device"] > 0) == fused
        assert eng.stats.accepted > 0 and eng.all_blocks_free()
        outs[fused] = got
    assert outs[True] == outs[False]
    assert outs[True][0][1] == want[1]  # the greedy row is target-only's


@pytest.mark.parametrize("tree", ["dynamic:16", "topk:2x3"])
def test_fused_sampled_rows_equal_the_unfused_ones(tiny, tree):
    """Steps with sampled rows are fused too (the sampled rule reads the trees from the verify inputs): seeded
    sampled and greedy rows in one batch give the same tokens as the unfused path (trees read on the host, the
    rule over host-built trees), at budgets N and 5, at batch 1 and 4."""
    draft, target, want = tiny
    _fused_vs_unfused_sampled(draft, target, tree, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_sampled_rows_equal_the_unfused_ones(setup):  # noqa: F811 - the fixture imported above
    """The same on the GPU in float32, draft program, verify and sampled rule captured."""
    target, draft, cfg, want = _on_gpu(setup)
    _fused_vs_unfused_sampled(draft, target, "dynamic:16", want, **cfg)


def test_tree_writer_at_budget_zero_writes_nothing_and_returns_what_building_would():
    """Budget 0 (plain decoding through the EAGLE step) keeps no nodes: the writer returns at once, without
    touching the verify inputs, the (R, 0) tokens, parents and ranks and zero depths that building the trees gives."""
    from specdec.tree_writer import TreeWriter

    r, b, q, nodes = 3, 4, 8, 6
    out = torch.stack([torch.randint(0, 50, (r, nodes)), torch.arange(-1, nodes - 1).expand(r, nodes),
                       torch.stack([torch.randperm(nodes) for _ in range(r)])], 1)  # (R, 3, N): a chain
    inputs = StepInputs(b, q, 2, torch.device("cpu"))
    views = inputs.views(b, q)
    views.ids.view(b, q)[:] = 7
    before = inputs.dev.clone()
    writer = TreeWriter(levels=nodes, device=torch.device("cpu"))
    got = writer(views, b, q, out, 0)
    want = writer._build(StepInputs(b, q, 2, torch.device("cpu")).views(b, q), b, q, out.clone(), 0)
    assert torch.equal(inputs.dev, before) and not writer.graphs
    assert [tuple(t.shape) for t in got] == [(r, 0), (r, 0), (r, 1), (r, 0)]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    assert torch.equal(got[2], torch.zeros(r, 1, dtype=torch.int64))
    assert got[0] is writer(views, b, q, out, 0)[0]  # one read-only set per row count
