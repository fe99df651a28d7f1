"""The static-buffer (graphed) step: padded inputs, device-side greedy acceptance, bucket padding.

On the CPU ``SpecConfig(cuda_graphs=True)`` runs the same padded step as on CUDA, only without the
capture, so everything but ``graph.replay()`` is tested here; the GPU tests at the bottom compare
replayed graphs with eager execution in float32.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specdec.acceptance import verify_greedy
from specdec.acceptance_batched import accept_greedy_padded, unpack_greedy
from specdec.engine import SpecConfig, SpecEngine
from specdec.graphs import QUERY_BUCKETS, bucket, query_buckets_for
from specdec.runner import RowInput
from specdec.sampling_params import SamplingParams
from specdec.step_inputs import StepInputs
from specdec.tree import DraftTree

pytestmark = pytest.mark.usefixtures("single_thread")


def _random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    parents = [rng.randrange(-1, i) for i in range(n)]
    return DraftTree.from_parents([rng.randrange(vocab) for _ in range(n)], parents)


def _padded(trees, argmax_rows, q):
    """(tokens, parents, mask, argmax, num_tokens) of trees in the padded verify layout."""
    b = len(trees)
    tokens, parents, mask, argmax = (torch.zeros(b, q, dtype=torch.int64) for _ in range(4))
    parents -= 1
    num = torch.zeros(b, dtype=torch.int64)
    for i, (t, am) in enumerate(zip(trees, argmax_rows)):
        h, n = t.host, t.num_nodes + 1
        masks, verify_parents = t.verify_rows()
        tokens[i, :n] = torch.tensor([7] + h.tokens)
        parents[i, :n] = torch.tensor(verify_parents)
        mask[i, :n] = torch.tensor(masks)
        argmax[i, :n] = am
        num[i] = n
    return tokens, parents, mask, argmax, num


@pytest.mark.parametrize("seed", range(6))
def test_device_greedy_acceptance_equals_host_rule(seed):
    """Random trees (small vocabulary, so sibling duplicates and long accepted paths occur), padded
    rows and a 63-node tree (bit 63 of the mask): same path and bonus as ``verify_greedy``."""
    rng = random.Random(seed)
    vocab = 3
    sizes = [rng.randrange(0, 20) for _ in range(9)] + [63, 0]
    trees = [_random_tree(rng, n, vocab) for n in sizes]
    argmax_rows = []
    for t in trees:  # the target agrees with the tree most of the time, so paths get deep
        h = t.host
        am = [rng.randrange(vocab) for _ in range(t.num_nodes + 1)]
        for i, p in enumerate(h.parents):
            if rng.random() < 0.7:
                am[p + 1] = h.tokens[i]
        argmax_rows.append(torch.tensor(am))
    q = 64
    out = accept_greedy_padded(*_padded(trees, argmax_rows, q)).tolist()
    depths = []
    for t, am, row in zip(trees, argmax_rows, out):
        want = verify_greedy(t, am)
        nodes, bonus = unpack_greedy(row)
        assert (nodes, bonus) == (list(want.accepted_nodes), want.bonus_token)
        depths.append(len(nodes))
    assert max(depths) >= 3  # the test reaches deep paths


def test_step_inputs_pad_rows_and_tokens():
    """A bucket's padding stores nothing (slot -1) and padded rows have zero queries."""
    inputs = StepInputs(max_batch=4, max_query=4, width=3, device=torch.device("cpu"))
    rows = [RowInput(None, [5, 6], [10, 11], 9, 12, [1, 3], parents=[-1, 0]),
            RowInput(None, [8], [3], 3, 4)]
    inputs.fill(4, 4, rows, [[40, 41], [7]], np.array([[1, 2, 0], [3, 0, 0]], dtype=np.int32))
    v = inputs.views(4, 4)
    assert v.ids.tolist()[:8] == [5, 6, 0, 0, 8, 0, 0, 0]
    assert v.slots.tolist() == [40, 41, -1, -1, 7] + [-1] * 11
    assert v.parents.tolist()[:4] == [-1, 0, -1, -1]
    assert v.qsl.tolist() == [0, 4, 8, 8, 8]  # rows 2 and 3: zero queries
    assert v.seq_lens.tolist() == [12, 4, 0, 0] and v.num_tokens.tolist() == [2, 1, 0, 0]
    assert v.block_tables.tolist() == [[1, 2, 0], [3, 0, 0], [0, 0, 0], [0, 0, 0]]
    inputs.fill(2, 1, [RowInput(None, [9], [4], 4, 5)], [[3]], np.array([[6, 0, 0]], dtype=np.int32))
    v = inputs.views(2, 1)
    assert v.slots.tolist() == [3, -1] and v.qsl.tolist() == [0, 1, 1]


def test_buckets():
    assert [bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 8, 9)] == [1, 2, 4, 8, None]
    # the top query bucket is the most tokens a row can have, not the next power of two
    assert [query_buckets_for(n) for n in (1, 5, 9, 64)] == [(1,), (1, 2, 4, 5), (1, 2, 4, 8, 9), QUERY_BUCKETS]


def test_ngram_chain8_verifies_in_a_9_token_bucket(tiny_target):
    from specdec.adaptive import BudgetController, budget_options

    eng = SpecEngine("ngram", tiny_target, SpecConfig(tree="chain:8", num_blocks=64, block_size=8, max_batch_size=4,
                                                      cuda_graphs=True))
    assert eng.runner.graphs.query_buckets[0] == (1, 2, 4, 8, 9)
    ctrl = BudgetController(budget_options(eng.drafter), query_buckets=eng.runner.graphs.query_buckets[0])
    assert [(o.nodes, ctrl.query_key(o.nodes + 1)) for o in ctrl.options] == [(0, 1), (1, 2), (3, 4), (7, 8), (8, 9)]


NEW = 16
PROMPT_LENS = [3, 9, 14, 5, 21, 7, 11]  # 7 rows: the batch-8 bucket has a padded row


def _prompts(n_rows):
    g = torch.Generator().manual_seed(11)
    lens = (PROMPT_LENS * 5)[:n_rows]
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def reference_tokens(tiny_target):
    eng = SpecEngine(None, tiny_target, SpecConfig(num_blocks=256, block_size=8, prefix_cache=False,
                                                   cuda_graphs=False))
    outs = eng.generate(_prompts(7), SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("draft,tree", [(None, "chain:4"), ("ngram", "chain:6"), ("model", "chain:3"),
                                        ("model", "topk:2x2"), ("model", "dynamic:12")])
def test_padded_step_spec_equals_eager_target_only(tiny_target, tiny_draft, reference_tokens, draft, tree):
    """Graph-path engine (CPU: padded static buffers, no capture) == eager target-only, batch 7."""
    d = {"model": tiny_draft, "ngram": "ngram", None: None}[draft]
    eng = SpecEngine(d, tiny_target, SpecConfig(tree=tree, num_blocks=256, block_size=8, prefix_cache=False,
                                                cuda_graphs=True, max_batch_size=8))
    assert eng.runner.graphs is not None
    outs = eng.generate(_prompts(7), SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference_tokens
    assert eng.all_blocks_free()
    if draft == "model":
        assert eng.stats.mean_accepted_length > 1.2  # the noisy-copy draft is accepted, paths are adopted


def test_padded_step_takes_the_device_acceptance(tiny_target, monkeypatch):
    """With static buffers the greedy outcome comes from the device tensor, not the host rule."""
    import specdec.verifier as verifier

    def forbidden(*args, **kwargs):
        raise AssertionError("host greedy rule used on the padded path")

    monkeypatch.setattr(verifier, "verify_greedy", forbidden)
    eng = SpecEngine("ngram", tiny_target, SpecConfig(tree="chain:4", num_blocks=128, block_size=8,
                                                      cuda_graphs=True, max_batch_size=4))
    outs = eng.generate(_prompts(3), SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in outs)


def test_cuda_graphs_option_is_validated():
    with pytest.raises(ValueError, match="cuda_graphs"):
        SpecConfig(cuda_graphs="yes")


# ---------------------------------------------------------------- GPU: replay == eager (float32)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.parametrize("n_rows", [1, 7, 32])
@pytest.mark.parametrize("draft,tree", [(None, "chain:4"), ("ngram", "chain:8"), ("model", "chain:4"),
                                        ("model", "topk:2x3"), ("model", "dynamic:16")])
def test_gpu_graph_replay_equals_eager(tiny_dirs, draft, tree, n_rows):
    """float32 on the GPU: graphs on (captured, replayed) give the tokens of eager target-only decoding."""
    from specdec.loading.registry import load_model

    target = load_model(tiny_dirs["llama"], device="cuda")
    prompts = _prompts(n_rows)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    base = dict(num_blocks=1024, block_size=16, prefix_cache=False, device="cuda", max_batch_size=32)
    ref = SpecEngine(None, target, SpecConfig(cuda_graphs=False, **base)).generate(prompts, params)
    d = {"model": load_model(tiny_dirs["llama_draft"], device="cuda"), "ngram": "ngram", None: None}[draft]
    eng = SpecEngine(d, target, SpecConfig(tree=tree, cuda_graphs=True, **base))
    assert eng.graph_report is not None and eng.graph_report.graphs > 0
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert eng.all_blocks_free()



@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("vocab,max_n", [(3, 4), (6, 2), (50, 3)])
def test_ngram_index_equals_lookup_as_tokens_grow(vocab, max_n, shared):
    """The incremental n-gram index proposes exactly what the scanning lookup proposes, at every length;
    also with a shared table that holds only this request's text."""
    from specdec.drafters.ngram import NgramIndex, SharedNgrams, ngram_lookup

    rng = random.Random(vocab)
    tokens = [rng.randrange(vocab) for _ in range(5)]
    index = NgramIndex(max_n, 1, SharedNgrams() if shared else None)
    hits = 0
    for _ in range(300):
        k = rng.randrange(0, 9)
        want = ngram_lookup(tokens, k, max_n)
        assert index.lookup(tokens, k) == want
        hits += bool(want)
        tokens += [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
    assert hits > 50


def test_fused_projections_stand_in_only_while_valid(tiny_target):
    """Fused q/k/v and gate/up weights are used for inference only while the projections are views of them."""
    import copy

    from specdec.models.llama import _fused_valid

    model = copy.deepcopy(tiny_target.model).fuse()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert _fused_valid(attn.q_proj, attn.qkv_weight) and _fused_valid(mlp.gate_proj, mlp.gate_up_weight)
    assert torch.equal(attn.qkv_weight[: attn.q_proj.weight.shape[0]], attn.q_proj.weight)
    converted = copy.deepcopy(model).double()  # .to()/.float() replace the parameters: back to separate matmuls
    assert not _fused_valid(converted.model.layers[0].self_attn.q_proj, converted.model.layers[0].self_attn.qkv_weight)
    model.requires_grad_(True)
    with torch.enable_grad():  # training needs gradients of the separate projections
        assert not _fused_valid(attn.q_proj, attn.qkv_weight)
    with torch.no_grad():
        assert _fused_valid(attn.q_proj, attn.qkv_weight)


@pytest.mark.parametrize("draft,tree,max_num_tokens", [(None, "chain:4", 2048), ("ngram", "chain:6", 2048),
                                                       ("ngram", "chain:6", 100)])
def test_long_prompts_prefill_as_graphed_pieces(tiny_target, monkeypatch, draft, tree, max_num_tokens):
    """Prompts longer than a verify bucket are prefilled as 64-token causal pieces, the rows of padded prefill
    steps (several pieces of one prompt in one step), never eagerly; chunked (max_num_tokens 100) or not, the
    output equals eager target-only decoding."""
    from specdec.runner import ModelRunner
    from specdec.step_inputs import PREFILL, PREFILL_QUERY

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (150, 7, 64, 65, 200)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    ref = SpecEngine(None, tiny_target, SpecConfig(num_blocks=256, block_size=8, prefix_cache=False,
                                                   cuda_graphs=False)).generate(prompts, params)
    eng = SpecEngine(None if draft is None else "ngram", tiny_target, SpecConfig(
        tree=tree, num_blocks=256, block_size=8, prefix_cache=False, cuda_graphs=True, max_batch_size=4,
        max_num_tokens=max_num_tokens))
    assert eng.runner.graphs.query_buckets[PREFILL] == (PREFILL_QUERY,)
    keys, eager = [], []
    run_packed, forward_eager = eng.runner.graphs.run_packed, ModelRunner._forward_eager
    monkeypatch.setattr(eng.runner.graphs, "run_packed",
                        lambda key, *a, **k: keys.append(key) or run_packed(key, *a, **k))
    monkeypatch.setattr(ModelRunner, "_forward_eager",
                        lambda self, m, *a, **k: eager.append(m) or forward_eager(self, m, *a, **k))
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert eager == []
    prefill = [k for k in keys if k[0] == PREFILL]
    assert prefill and all(k[2] == PREFILL_QUERY for k in prefill)
    if max_num_tokens == 2048:  # the 200-token prompt's 4 pieces go in one step (a batch bucket of >= 4 rows)
        assert max(k[1] for k in prefill) == 4
    assert eng.all_blocks_free()


def test_ngram_drafter_indexes_prompts_at_prefill_and_forgets_ended_requests():
    """The prompt is indexed chunk by chunk as it is prefilled (not by a request's first, timed proposal);
    indexes of finished requests are dropped once the table has grown."""
    from specdec.scheduler.request import Request, RequestStatus
    from specdec.scheduler.scheduler import PrefillChunk

    from specdec.drafters.ngram import NgramDrafter, ngram_lookup

    drafter = NgramDrafter(4)
    reqs = [Request(str(i), [5, 6, 7, 5, 6, 7, 5], SamplingParams(max_new_tokens=8)) for i in range(65)]
    drafter.prefill([PrefillChunk(reqs[0], 0, 3)])
    assert drafter._index[reqs[0]].indexed == 4  # n-grams followed by a known token: up to position 4
    drafter.prefill([PrefillChunk(reqs[0], 3, 6)])
    assert drafter._index[reqs[0]].indexed == 7
    assert drafter.propose(reqs[:1]).trees[0].host.tokens == ngram_lookup(reqs[0].tokens, 4) == [6, 7, 5]
    drafter.prefill([PrefillChunk(r, 0, 6) for r in reqs[1:64]])
    for r in reqs[:64]:
        r.status = RequestStatus.FINISHED
    drafter.prefill([PrefillChunk(reqs[64], 0, 6)])
    assert list(drafter._index) == [reqs[64]]


def test_capture_graph_holds_the_garbage_collector(monkeypatch):
    """The collector is off while ``capture_graph`` captures (a dead engine collected mid-capture invalidates
    it), on again afterwards, also when the capture raises, and left off when it was off (CUDA stood in)."""
    import contextlib
    import gc

    import specdec.graphs as cg

    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())

    def forward():
        seen.append(gc.isenabled())
        return len(seen)

    was = gc.isenabled()
    try:
        gc.enable()
        assert cg.capture_graph(forward, None, "cpu")[1] == 2 and seen == [True, False] and gc.isenabled()

        def failing():
            seen.append(gc.isenabled())
            if len(seen) == 4:  # its second run: the captured one
                raise RuntimeError("capture failed")

        with pytest.raises(RuntimeError, match="capture failed"):
            cg.capture_graph(failing, None, "cpu")
        assert seen[2:] == [True, False] and gc.isenabled()
        gc.disable()
        cg.capture_graph(forward, None, "cpu")
        assert not gc.isenabled()
    finally:
        gc.enable() if was else gc.disable()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capture_graph_counts_every_capture_gpu():
    """``graphs.CAPTURED`` counts each capture and its seconds (the bench reads it around timed rounds)."""
    from specdec.graphs import CAPTURED, capture_graph

    x = torch.zeros(4, device="cuda")
    graphs, seconds = CAPTURED.graphs, CAPTURED.seconds
    graph, out = capture_graph(lambda: x + 1, None, x.device)
    x.fill_(2)
    graph.replay()
    assert out.tolist() == [3.0] * 4
    assert CAPTURED.graphs == graphs + 1 and CAPTURED.seconds > seconds


def test_parts_captured_on_first_use_are_counted_in_the_graph_report(monkeypatch, tiny_target):
    """The parts of a step that capture on first use keep their graphs in caches the ``GraphRunner`` made, so
    ``engine.graph_report.parts`` counts them by part; a pool of its own is made at its first capture only (none
    on the CPU), a cache made without a runner is counted nowhere else (CUDA stood in)."""
    import specdec.graphs as cg

    monkeypatch.setattr(cg, "capture_graph", lambda forward, pool, device: (("graph", pool), forward()))
    cfg = SpecConfig(tree="chain:4", cuda_graphs=True, pipeline=True, ngram_device=True, num_blocks=64, block_size=8)
    eng = SpecEngine("ngram", tiny_target, cfg)
    graphs = eng.runner.graphs
    names = {c.name for c in graphs.caches}
    assert {"sampled rule", "queued-step writer", "n-gram follow-up"} <= names
    rule = next(c for c in graphs.caches if c.name == "sampled rule")
    assert rule.pool == "own"
    rule[("k", 1)] = rule.capture(lambda: 7)
    assert rule[("k", 1)] == (("graph", None), 7) and rule.pool is None
    assert graphs.parts()["sampled rule"] == 1 and graphs.parts()["n-gram follow-up"] == 0
    report = cg.CaptureReport(parts=graphs.parts())
    assert "(it captured 1 sampled rule)" in str(report)
    alone = cg.cache_for(None, "tree writer", "cpu")
    alone[1] = alone.capture(lambda: 1)
    assert alone not in graphs.caches and len(alone) == 1
