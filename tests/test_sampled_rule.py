"""The captured sampled rule (``specdec.sampled_rule``): its outcome equals the host rule's (``verifier._host_rule``)
on the same trees with greedy rows kept; its CUDA path (a stand-in graph on the CPU) equals its eager run; and in
the engine a seeded request gets the same tokens from the host rule, the eager device rule and the graphed rule,
whatever the batch composition, and whatever proposer, tree or budget verified it (the rule's choice at a
position depends only on the request's key, the position and the target). The CUDA tests at the bottom capture
real graphs."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest
import torch

from specdec.acceptance_batched import accept_greedy_padded, pad_trees
from specdec.engine import SpecConfig, SpecEngine
from specdec.sampled_rule import SampledRule
from specdec.sampling_params import SamplingParams
from specdec.tree import DraftTree
from specdec.uniform_stream import UniformStream
from specdec.verifier import _host_rule

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB, Q = 7, 6


def _case(seed: int, b: int = 8, r: int = 6, plain: bool = False, chains: bool = False):
    """(rows, trees, logits (B * Q, V), greedy accept (B, Q + 3)) of r real rows in a bucket of b: deterministic
    chains and trees (``chains``: chains only), empty trees, greedy and sampled rows (seeded streams; ``plain``: no
    top-k/top-p), rows of different lengths, random finite flags."""
    rng = random.Random(seed)
    trees, rows = [], []
    for i in range(r):
        n = rng.choice([0, 1, 3, 5])
        parents = [j - 1 if chains or rng.random() < 0.7 else rng.randrange(-1, j) for j in range(n)]
        trees.append(DraftTree.from_parents([rng.randrange(VOCAB) for _ in range(n)], parents) if n else
                     DraftTree.empty())
        params = SamplingParams() if i % 3 == 1 else SamplingParams(
            temperature=rng.choice([0.6, 1.0]), top_k=0 if plain else rng.choice([0, 3]),
            top_p=1.0 if plain else rng.choice([1.0, 0.8]), seed=i)
        rows.append(SimpleNamespace(params=params, stream=None if params.greedy else UniformStream(seed * 100 + i),
                                    tokens=[1] * rng.randrange(3, 40), penalized=False))
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(b, Q, VOCAB, generator=g)
    for t, lg in zip(trees, logits):  # the target often agrees with the tree, so paths get deep
        for j, p in enumerate(t.host.parents):
            lg[p + 1, t.host.tokens[j]] += 3.0 * (rng.random() < 0.6)
    padded = pad_trees(trees + [DraftTree.empty()] * (b - r), Q, "cpu")
    greedy = accept_greedy_padded(padded.tokens, padded.parents, padded.tree_mask, logits.argmax(-1),
                                  padded.num_tokens)  # (B, Q + 2)
    finite = torch.tensor([[rng.random() < 0.9] for _ in range(b)], dtype=torch.int64)
    return rows, trees, logits.view(b * Q, VOCAB), torch.cat([greedy, finite], 1)


def _assert_outcome(got, rows, trees, logits, accept):
    """Sampled rows of ``got`` (B, Q + 3) hold the host rule's path and bonus token; the others (and every finite
    flag) are ``accept``'s. Returns the sampled rows' accepted counts."""
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    lg = logits.view(accept.shape[0], Q, VOCAB)
    counts = []
    for i in range(accept.shape[0]):
        if i not in sampled:
            assert torch.equal(got[i], accept[i]), i
            continue
        host = _host_rule(rows[i], trees[i], lg[i, :trees[i].num_nodes + 1])
        m = len(host.accepted_nodes)
        assert got[i, 0] == m and got[i, 1] == host.bonus_token, i
        assert [j - 1 for j in got[i, 2:2 + m].tolist()] == list(host.accepted_nodes), i
        assert got[i, -1] == accept[i, -1]
        counts.append(m)
    return counts


@pytest.mark.parametrize("chains", [False, True], ids=["trees", "chains"])
def test_rule_equals_the_host_rule_with_greedy_rows_kept(chains):
    """Batches of trees with siblings and of chains only: the captured rule's outcome is the host rule's."""
    deepest, moved = 0, 0
    for seed in range(10):
        rows, trees, logits, accept = _case(seed, chains=chains)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        got = SampledRule("cpu")(rows, trees, sampled, logits, accept, captured=False)
        deepest = max(deepest, *_assert_outcome(got, rows, trees, logits, accept))
        moved += not torch.equal(got[sampled], accept[sampled])
    assert deepest >= 2 and moved >= 6  # deep paths, and sampled rows really sample


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels on the CPU need TRITON_INTERPRET=1")
def test_rule_with_the_kernels_equals_the_references():
    """The rule with its Triton kernels (the token choice and the top-k / top-p filter, interpreted) gives the torch
    references' outcome, filtered rows and plain ones."""
    for seed in range(4):
        rows, trees, logits, accept = _case(seed, plain=seed % 2 == 1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        want = SampledRule("cpu")(rows, trees, sampled, logits, accept, captured=False)
        got = SampledRule("cpu", use_triton=True)(rows, trees, sampled, logits, accept, captured=False)
        assert torch.equal(got, want), seed


def test_choices_follow_the_position_not_the_tree():
    """A sampled row's bonus token after an empty tree at length L is the token its tree's path would have given
    at that position: moving the row (a longer context) changes it; the same position with another tree does not
    (the first token of the path, or the bonus when nothing is accepted, is the choice at the root)."""
    rows, trees, logits, accept = _case(3, chains=True)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    empty = [DraftTree.empty()] * len(trees)
    got = SampledRule("cpu")(rows, trees, sampled, logits, accept, captured=False)
    alone = SampledRule("cpu")(rows, empty, sampled, logits, accept, captured=False)
    for i in sampled:
        first = got[i, 1] if got[i, 0] == 0 else trees[i].host.tokens[got[i, 2] - 1]
        assert alone[i, 1] == first, i
    shifted = [SimpleNamespace(params=r.params, stream=r.stream, tokens=r.tokens + [1], penalized=False) for r in rows]
    moved = SampledRule("cpu")(shifted, empty, sampled, logits, accept, captured=False)
    assert sum(int(moved[i, 1] != alone[i, 1]) for i in sampled) >= 1


def _stand_in_capture(build, pool, device):
    """``capture_graph`` stood in on the CPU: the function runs once (as before a real capture), its output tensor
    is kept, and each replay reruns the function and rewrites that tensor in place, as a CUDA graph's replay does."""
    out = build()
    graph = SimpleNamespace(replays=0)

    def replay():
        graph.replays += 1
        with torch.inference_mode():
            out.copy_(build())

    graph.replay = replay
    return graph, out


def test_graph_path_equals_eager_with_a_stand_in_graph(monkeypatch):
    """The captured path reads each step's inputs from its one upload and the verify's fixed output buffers
    (rewritten in place between steps): one graph per bucket and filter flag, replayed, equal to eager."""
    import specdec.graphs as cg

    monkeypatch.setattr(cg, "capture_graph", _stand_in_capture)
    graphed = SampledRule("cpu", capture=True)
    logits, accept = None, None
    for seed in range(6):
        rows, trees, lg, acc = _case(seed, plain=seed >= 3, chains=seed % 2 == 1)
        if logits is None:
            logits, accept = lg.clone(), acc.clone()  # the verify graph's output buffers
        logits.copy_(lg)
        accept.copy_(acc)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        want = SampledRule("cpu")(rows, trees, sampled, lg, acc, captured=False)
        assert torch.equal(graphed(rows, trees, sampled, logits, accept, captured=True), want)
    flags = [key[3] for key in graphed.graphs]  # (kind, B, Q, filtered, ...): each filter flag its own graph
    assert sorted(flags) == [False, True]
    assert sum(g.replays for g, *_ in graphed.graphs.values()) == 6


# ---------------------------------------------------------------- the engine: every path, the same tokens

PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [9, 8] * 6, [17, 4, 99, 23, 17, 4, 99], list(range(40, 52)) * 2]
PARAMS = [SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_new_tokens=12, ignore_eos=True),
          SamplingParams(max_new_tokens=10, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=20, seed=7, max_new_tokens=14, ignore_eos=True),
          SamplingParams(temperature=1.2, seed=3, max_new_tokens=12, ignore_eos=True)]


def stand_in_verify_graphs(monkeypatch, eng) -> dict:
    """CUDA stood in for ``eng``: every verify bucket counts as captured and its replays rewrite one set of
    output tensors per bucket (as a graph's replays do); the sampled rule captures stand-in graphs. Returns the
    replays per bucket."""
    import specdec.graphs as cg

    graphs, outs, replays = eng.runner.graphs, {}, {}

    def replay(key):
        new = graphs._forward(key)
        replays[key] = replays.get(key, 0) + 1
        if key not in outs:
            outs[key] = new
        with torch.inference_mode():  # (the forward's outputs are inference tensors)
            for kept, fresh in zip(outs[key], new):
                if kept is not None and kept is not fresh:
                    kept.copy_(fresh)
        return outs[key]

    monkeypatch.setattr(graphs, "replay", replay)
    monkeypatch.setattr(graphs, "captured", lambda key: True)
    monkeypatch.setattr(cg, "capture_graph", _stand_in_capture)
    eng.verifier.sampled_rule.capture = True
    return replays


@pytest.mark.parametrize("draft,tree", [("ngram", "chain:4"), (None, "chain:4")])
def test_seeded_tokens_equal_on_every_path_and_batch(tiny_target, monkeypatch, draft, tree):
    """Eager engine (host rule) == padded step (the device rule eagerly, at any row count)
    == the eager device rule == the graphed rule (CUDA stood in: the host rule forbidden), at batch 4, batch 1,
    in reverse order and with greedy rows added to the batch."""
    import specdec.verifier as verifier

    make = lambda graphs, **kw: SpecEngine(draft, tiny_target, SpecConfig(tree=tree, num_blocks=256, block_size=8,
                                                                          cuda_graphs=graphs, **kw))
    want = [o.token_ids for o in make(False).generate(PROMPTS, PARAMS)]
    assert want == [o.token_ids for o in make(True, max_batch_size=4).generate(PROMPTS, PARAMS)]
    monkeypatch.setattr(verifier, "DEVICE_SAMPLED_MIN_ROWS", 1)
    assert want == [o.token_ids for o in make(True, max_batch_size=4).generate(PROMPTS, PARAMS)]
    monkeypatch.undo()

    def forbidden(*args, **kwargs):
        raise AssertionError("host stochastic rule used on the graphed path")

    monkeypatch.setattr(verifier, "_host_rule", forbidden)
    extra = [SamplingParams(max_new_tokens=9, ignore_eos=True)] * 3
    for batch, order, more in ((4, 1, 0), (1, 1, 0), (4, -1, 0), (8, 1, 3)):
        eng = make(True, max_batch_size=batch)
        replays = stand_in_verify_graphs(monkeypatch, eng)
        outs = eng.generate(PROMPTS[::order] + PROMPTS[:more], PARAMS[::order] + extra[:more])
        assert not any(o.error for o in outs), [o.error for o in outs]  # a host-rule call would fail its request
        assert [o.token_ids for o in outs[:4]][::order] == want, (batch, order, more)
        rule = eng.verifier.sampled_rule
        assert rule.graphs and sum(g.replays for g, *_ in rule.graphs.values()) > 0 and replays
        assert eng.all_blocks_free() and (eng.stats.drafted > 0) == (draft is not None)
        monkeypatch.setattr(verifier, "_host_rule", forbidden)


@pytest.mark.parametrize("draft", ["ngram", None])
def test_processed_rows_take_the_captured_rule(tiny_target, monkeypatch, draft):
    """Rows with penalties, a bias or ``min_tokens`` (greedy and sampled) take the captured rule too, over the graph's
    own copies of their processors' inputs refilled at each replay (CUDA stood in, pipelined): the eager engine's
    tokens, with one graph per processors' layout and replays of it."""
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0),
              SamplingParams(temperature=0.8, seed=7, max_new_tokens=24, ignore_eos=True, repetition_penalty=4.0),
              SamplingParams(max_new_tokens=10, min_tokens=8, logit_bias={3: 2.0}),
              SamplingParams(temperature=1.2, seed=3, max_new_tokens=12, ignore_eos=True)]
    make = lambda graphs, **kw: SpecEngine(draft, tiny_target, SpecConfig(tree="chain:4", num_blocks=256,
                                                                          block_size=8, cuda_graphs=graphs, **kw))
    want = [o.token_ids for o in make(False).generate(PROMPTS, params)]
    eng = make(True, max_batch_size=4, pipeline=True, adaptive=False, ngram_device=draft is not None or None)
    stand_in_verify_graphs(monkeypatch, eng)
    outs = eng.generate(PROMPTS, params)
    assert not any(o.error for o in outs) and [o.token_ids for o in outs] == want
    processed = [g for key, (g, *_, fixed) in eng.verifier.sampled_rule.graphs.items() if fixed is not None]
    assert processed and sum(g.replays for g in processed) > 1 and eng.pipeline.adopted > 0


@pytest.mark.parametrize("tree", ["chain:3", "topk:2x2"])
def test_draft_model_rows_sample_on_the_device(tiny_target, tiny_draft, monkeypatch, tree):
    """cuda_graphs=True with a draft model: sampled rows never reach the host rule, and their tokens equal the eager
    engine's at batch 4 and batch 1."""
    import specdec.verifier as verifier

    make = lambda graphs, **kw: SpecEngine(tiny_draft, tiny_target, SpecConfig(tree=tree, num_blocks=256,
                                                                               block_size=8, cuda_graphs=graphs, **kw))
    want = [o.token_ids for o in make(False).generate(PROMPTS, PARAMS)]

    def forbidden(*args, **kwargs):
        raise AssertionError("host rule used on the padded path")

    monkeypatch.setattr(verifier, "_host_rule", forbidden)
    for batch in (4, 1):
        eng = make(True, max_batch_size=batch)
        assert eng.runner.graphs is not None
        outs = eng.generate(PROMPTS, PARAMS)
        assert not any(o.error for o in outs), [o.error for o in outs]  # a host-rule call would fail its request
        assert [o.token_ids for o in outs] == want, batch
        assert eng.all_blocks_free() and eng.stats.accepted > 0


def test_seeded_tokens_do_not_depend_on_the_proposer_the_budget_or_the_batch(tiny_target, tiny_draft):
    """float32: a seeded request's tokens are target-only decoding's whatever speculates for it (n-gram chains, a
    draft model's chains, top-k and dynamic trees, whose sampled children are drawn), at a fixed budget or under
    the per-step controller (budgets that change from step to step), padded or not, alone or in a batch with
    greedy rows: each token is the target's own choice at its position."""
    cfg = dict(num_blocks=256, block_size=8)
    want = [o.token_ids for o in SpecEngine(None, tiny_target, SpecConfig(**cfg)).generate(PROMPTS, PARAMS)]
    drafted = 0
    for draft, tree, extra in (("ngram", "chain:4", {}), (tiny_draft, "chain:3", {}), (tiny_draft, "topk:2x2", {}),
                               (tiny_draft, "dynamic:6", {"adaptive": True}), ("ngram", "chain:4", {"adaptive": True}),
                               (tiny_draft, "topk:2x2", {"cuda_graphs": True, "max_batch_size": 2})):
        eng = SpecEngine(draft, tiny_target, SpecConfig(tree=tree, **cfg, **extra))
        assert [o.token_ids for o in eng.generate(PROMPTS, PARAMS)] == want, (tree, extra)
        alone = eng.generate([PROMPTS[2]], [PARAMS[2]])[0].token_ids
        assert alone == want[2], (tree, extra)
        drafted += eng.stats.accepted
    assert drafted > 0


# ---------------------------------------------------------------- CUDA: real graphs

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
def test_gpu_captured_rule_equals_eager_and_cpu():
    """A captured rule, replayed over new verify outputs and inputs, gives its eager run's outcome, and the CPU's
    (a choice whose two best scores are within rounding of each other may rarely differ)."""
    graphed, eager = SampledRule("cuda"), SampledRule("cuda", capture=False)
    logits, accept = None, None
    same = total = 0
    for seed in range(6):
        rows, trees, lg, acc = _case(seed, b=16, r=13)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        want = SampledRule("cpu")(rows, trees, sampled, lg, acc, captured=False)
        if logits is None:
            logits, accept = lg.cuda(), acc.cuda()
        logits.copy_(lg)
        accept.copy_(acc)
        got = graphed(rows, trees, sampled, logits, accept, captured=True).cpu()
        assert torch.equal(got, eager(rows, trees, sampled, logits, accept, captured=False).cpu())
        same += (got == want).all(1).sum().item()
        total += len(rows)
    assert graphed.graphs and same >= 0.98 * total, (same, total)


@gpu
@pytest.mark.parametrize("draft", ["ngram", None])
def test_gpu_engine_graphed_sampling_equals_eager(tiny_dirs, draft):
    """float32 on the GPU: the engine with CUDA graphs (the captured sampled rule, whatever the sampled row count)
    samples a seeded request's tokens as the eager engine (host rule) does."""
    from specdec.loading.registry import load_model

    target = load_model(tiny_dirs["llama"], device="cuda")
    base = dict(tree="chain:4", num_blocks=1024, block_size=16, device="cuda", max_batch_size=32, adaptive=False)
    want = [o.token_ids for o in SpecEngine(draft, target, SpecConfig(cuda_graphs=False, **base)).generate(
        PROMPTS, PARAMS)]
    eng = SpecEngine(draft, target, SpecConfig(cuda_graphs=True, **base))
    assert [o.token_ids for o in eng.generate(PROMPTS, PARAMS)] == want
    assert eng.verifier.sampled_rule.graphs and eng.all_blocks_free()
