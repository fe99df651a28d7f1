"""``accept_stochastic_padded`` in a real batch: greedy rows, padded rows, empty trees, argument errors, and the
engine's padded step (``cuda_graphs=True``; on the CPU it runs eagerly over the same buffers) taking sampled
rows through the device rule. The CUDA test at the bottom compares the GPU with the CPU, and a captured CUDA
graph of the rule with its eager run."""

from __future__ import annotations

import pytest
import torch
from test_acceptance_stochastic import _random_case

from specdec.acceptance import sample_token, shape_probs
from specdec.acceptance_batched import accept_greedy_padded, unpack_greedy
from specdec.acceptance_stochastic import (
    PaddedTrees,
    accept_stochastic_padded,
    draw_uniforms,
    pad_trees,
    sampling_rows,
)
from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams
from specdec.tree import DraftTree
from specdec.uniform_stream import UniformStream

pytestmark = pytest.mark.usefixtures("single_thread")


def _inputs(trees, logits, params, seed=0, device="cpu"):
    """(logits, PaddedTrees, RowSampling, uniforms) of one row per tree; greedy rows draw no uniforms."""
    q = logits.shape[1]
    streams = [None if p.greedy else UniformStream(seed + i) for i, p in enumerate(params)]
    uniforms = draw_uniforms(streams, trees, q, "cpu")
    return (logits.to(device), pad_trees(trees, q, device), sampling_rows(params, device), uniforms.to(device))


def test_greedy_rows_of_a_mixed_batch_are_exactly_greedy():
    trees, logits, params = _random_case(7)
    params = [SamplingParams() if i % 2 else p for i, p in enumerate(params)]  # every other row greedy
    lg, padded, sampling, u = _inputs(trees, logits, params)
    got = accept_stochastic_padded(lg, padded, sampling, u)
    want = accept_greedy_padded(padded.tokens, padded.parents, padded.tree_mask, lg.argmax(-1), padded.num_tokens)
    greedy = torch.tensor([p.greedy for p in params])
    assert torch.equal(got[greedy], want[greedy])
    assert not torch.equal(got[~greedy], want[~greedy])  # sampled rows really sample
    assert max(unpack_greedy(r)[0].__len__() for r in want[greedy].tolist()) >= 2


def _order(n: int, at: list[int]) -> torch.Tensor:
    """Index that places n real rows and len(at) filler rows (stacked after them) so the fillers sit at ``at``."""
    order = list(range(n))
    for k, i in enumerate(sorted(at)):
        order.insert(i + k, n + k)
    return torch.tensor(order)


def test_padded_rows_accept_nothing_and_change_nothing():
    """Rows with num_tokens 0 (a bucket's padding) accept nothing; the real rows' outcomes do not move."""
    trees, logits, params = _random_case(8)
    lg, padded, sampling, u = _inputs(trees, logits, params)
    alone = accept_stochastic_padded(lg, padded, sampling, u)
    n, at = len(trees), [0, 3, len(trees)]
    order = _order(n, at)

    def widen(t, fill=None):  # filler rows: copies of row 0, or `fill`
        extra = t[:1].expand(len(at), *t.shape[1:]) if fill is None else torch.full_like(t[:len(at)], fill)
        return torch.cat([t, extra])[order]

    wide = PaddedTrees(widen(padded.tokens, 0), widen(padded.parents, -1), widen(padded.tree_mask, 0),
                       widen(padded.dist_index, -1), widen(padded.num_tokens, 0), widen(padded.child_mode),
                       padded.dists, padded.max_trials, padded.modes)
    both = accept_stochastic_padded(widen(lg), wide, sampling._replace(
        temperature=widen(sampling.temperature), top_k=widen(sampling.top_k), top_p=widen(sampling.top_p),
        min_p=widen(sampling.min_p)), widen(u))
    keep = order < n
    assert torch.equal(both[keep], alone)
    assert both[~keep][:, 0].tolist() == [0] * len(at)
    assert alone[:, 0].max() >= 2  # real rows accept paths


def test_empty_trees_sample_the_bonus_from_the_target():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 4, 6, generator=g)
    params = [SamplingParams(temperature=0.9, top_p=0.9)] * 40
    trees = [DraftTree.empty()] * 40
    lg, padded, sampling, u = _inputs(trees, logits, params, seed=50)
    out = accept_stochastic_padded(lg, padded, sampling, u)
    assert out[:, 0].tolist() == [0] * 40
    want = [sample_token(shape_probs(logits[i, 0], 0.9, 0, 0.9), u[i, 0].item()) for i in range(40)]
    assert out[:, 1].tolist() == want
    assert len(set(want)) >= 3


def test_bad_arguments_name_the_field():
    trees, logits, params = _random_case(9)
    lg, padded, sampling, u = _inputs(trees, logits, params)
    with pytest.raises(ValueError, match="uniforms"):
        accept_stochastic_padded(lg, padded, sampling, u.float())
    with pytest.raises(ValueError, match="trees.tokens"):
        accept_stochastic_padded(lg[:, :5], padded, sampling, u)
    with pytest.raises(ValueError, match="sampling.top_p"):
        accept_stochastic_padded(lg, padded, sampling._replace(top_p=sampling.top_p[:2]), u)
    with pytest.raises(ValueError, match="trees.dists"):
        accept_stochastic_padded(lg, padded._replace(dists=padded.dists[:, :3]), sampling, u)
    with pytest.raises(ValueError, match="trees.dists is required"):
        accept_stochastic_padded(lg, padded._replace(dists=None), sampling, u)
    with pytest.raises(ValueError, match="max_trials"):
        accept_stochastic_padded(lg, padded._replace(max_trials=lg.shape[1]), sampling, u)
    with pytest.raises(ValueError, match=r"trees\[0\]"):
        pad_trees([DraftTree.chain([1, 2, 3])], 3, "cpu")


def test_max_trials_is_the_longest_walk():
    assert pad_trees([DraftTree.chain([1, 2, 3])], 8, "cpu").max_trials == 3
    # root -> {0, 1, 2}; 0 -> {3, 4}; 4 -> {5}: reach 4 after 1 + 2 trials, then try 5: 4 > 3 root children
    tree = DraftTree.from_parents([1, 2, 3, 4, 5, 6], [-1, -1, -1, 0, 0, 4])
    assert pad_trees([tree, DraftTree.empty()], 8, "cpu").max_trials == 4
    assert pad_trees([DraftTree.empty()], 1, "cpu").max_trials == 0


# ---------------------------------------------------------------- (e) the engine's padded step

PROMPTS = [[17, 4, 99, 23, 5, 61, 8], [3, 4, 5, 3, 4, 5, 3, 4], list(range(40, 60)), [9, 8] * 6]
PARAMS = [SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_new_tokens=12, ignore_eos=True),
          SamplingParams(max_new_tokens=10, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=20, seed=7, max_new_tokens=14, ignore_eos=True),
          SamplingParams(temperature=1.2, seed=3, max_new_tokens=12, ignore_eos=True)]


@pytest.mark.parametrize("draft,tree", [("model", "chain:3"), ("model", "topk:2x2"), ("ngram", "chain:4"),
                                        (None, "chain:4")])
def test_padded_step_samples_on_the_device(tiny_target, tiny_draft, monkeypatch, draft, tree):
    """cuda_graphs=True: sampled rows never reach the host rule, seeded output is reproducible, equal across
    batch composition, and equal to the eager engine's (both choose each token with the same keyed noise)."""
    import specdec.verifier as verifier

    d = tiny_draft if draft == "model" else draft  # None: target-only, one verify token per row (Q = 1)
    make = lambda graphs, **kw: SpecEngine(d, tiny_target, SpecConfig(tree=tree, num_blocks=256, block_size=8,
                                                                      cuda_graphs=graphs, **kw))
    eager = [o.token_ids for o in make(False).generate(PROMPTS, PARAMS)]

    def forbidden(*args, **kwargs):
        raise AssertionError("host stochastic rule used on the padded path")

    monkeypatch.setattr(verifier, "_host_rule", forbidden)
    eng = make(True, max_batch_size=4)
    assert eng.runner.graphs is not None
    first = eng.generate(PROMPTS, PARAMS)
    assert not any(o.error for o in first)  # a host-rule call would fail its request
    outs = [o.token_ids for o in first]
    assert outs == [o.token_ids for o in eng.generate(PROMPTS, PARAMS)]  # same engine, prefix cached
    assert outs == [o.token_ids for o in make(True, max_batch_size=1).generate(PROMPTS, PARAMS)]
    assert outs == eager
    assert eng.all_blocks_free() and (eng.stats.drafted > 0) == (draft is not None)
    if draft == "model":  # the noisy-copy draft is accepted (random n-gram proposals are only tried)
        assert eng.stats.accepted > 0


# ---------------------------------------------------------------- CUDA: GPU == CPU, graph replay == eager

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
def test_gpu_equals_cpu_and_graph_replay_equals_eager():
    """The rule on CUDA gives the CPU's outcomes (a coin landing on a rounding threshold may rarely differ),
    and a captured CUDA graph of it, replayed after new logits and uniforms are copied in, gives eager's."""
    trees, logits, params = _random_case(10)
    reps = 64
    trees, params, logits = trees * reps, params * reps, logits.repeat(reps, 1, 1)
    cpu = accept_stochastic_padded(*_inputs(trees, logits, params, seed=5))
    lg, padded, sampling, u = _inputs(trees, logits, params, seed=5, device="cuda")
    eager = accept_stochastic_padded(lg, padded, sampling, u)
    same = (eager.cpu() == cpu).all(1).float().mean().item()
    assert same >= 0.99, same
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = accept_stochastic_padded(lg, padded, sampling, u)
    for seed in (6, 7):
        new_lg, _, _, new_u = _inputs(trees, logits.roll(seed, dims=-1), params, seed=seed, device="cuda")
        lg.copy_(new_lg)
        u.copy_(new_u)
        graph.replay()
        assert torch.equal(out, accept_stochastic_padded(new_lg, padded, sampling, new_u))
