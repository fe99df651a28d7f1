"""The engine's warm-up (``specdec.warm_up``) runs every step shape once, so no graph is captured while real
requests run: CUDA stood in on the CPU (every verify counts as captured, ``capture_graph`` replaced by a stand-in
that reruns the function), a pipelined EAGLE engine whose sampled steps take the budget controller, as on CUDA.
After ``warm_up`` the queued-step advances, the tree writers and the sampled rule hold graphs, and greedy,
sampled and mixed batches of every size add none; greedy output still equals target-only decoding, and the
warm-up leaves no statistics, cached prefix, block or queued step behind."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from test_eagle import PROMPTS, setup  # noqa: F401 - the module's trained tiny draft, a fixture
from test_graph_pools import poisoning  # noqa: F401 - stand-in graphs poisoning their pool, a fixture
from test_sampled_rule import stand_in_verify_graphs

import specdec.graphs as cg
from specdec.budget_policy import make_controller
from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.registry import load_model
from specdec.pipeline import AdvanceGraphs
from specdec.sampling_params import SamplingParams
from specdec.warm_up import FixedBudget

pytestmark = pytest.mark.usefixtures("single_thread")


def _stand_in(build, pool, device):
    """``capture_graph`` on the CPU: the function runs once; each replay reruns it into the first output."""
    out = build()
    graph = SimpleNamespace(replays=0)

    def replay():
        graph.replays += 1
        with torch.inference_mode():
            new = build()
            for kept, fresh in zip(out if isinstance(out, tuple) else (out,),
                                   new if isinstance(new, tuple) else (new,)):
                if isinstance(kept, torch.Tensor) and kept is not fresh:
                    kept.copy_(fresh)

    graph.replay = replay
    return graph, out


def test_no_graph_is_captured_after_the_warm_up(setup, monkeypatch):  # noqa: F811
    root, _, _ = setup
    target = load_model(root / "target")
    draft = load_model(root / "full", target=target)
    plain = SpecEngine(None, target, SpecConfig(num_blocks=300, block_size=8))
    greedy = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 5, 9, 14)]
    want = [o.token_ids for o in plain.generate(PROMPTS[:4], greedy)]

    cfg = SpecConfig(tree="dynamic:16", num_blocks=300, block_size=8, max_batch_size=4, cuda_graphs=True,
                     pipeline=True, adaptive=False)
    eng = SpecEngine(draft, target, cfg)
    assert not eng.plan.warm_up  # (on the CPU it is off by default; CUDA's defaults set up by hand below)
    stand_in_verify_graphs(monkeypatch, eng)
    monkeypatch.setattr(cg, "capture_graph", _stand_in)  # (outputs that are tuples too)
    eng.adaptive = make_controller(True, eng.drafter, None, epochs=True)  # CUDA: budgets by epochs
    eng.plan = dataclasses.replace(eng.plan, adaptive=True, budget_epochs=True)
    eng.pipeline.hook.advance = advance = AdvanceGraphs(eng.device, capture=True)
    writer = eng.verifier.fused.writer
    writer.capture = True
    rule = eng.verifier.sampled_rule

    def graphs():
        return len(advance.graphs), len(writer.graphs), len(rule.graphs)

    assert eng.warm_up() > 0
    after = graphs()
    assert min(after) > 0, after
    assert eng.stats.target_forwards == 0 and eng.all_blocks_free() and eng.pipeline.ahead is None
    assert rule.context.present is None and rule.context.counts is None  # (the synthetic rows' contexts dropped)
    sampled = [SamplingParams(max_new_tokens=n, temperature=t, top_p=p, seed=i, ignore_eos=True)
               for i, (n, t, p) in enumerate(((10, 0.8, 1.0), (6, 1.0, 0.9), (8, 0.7, 0.9), (11, 1.2, 1.0)))]
    first = eng.generate(PROMPTS[:4], greedy)
    assert [o.token_ids for o in first] == want, [o.error for o in first]
    for batch in ([0], [0, 1, 2], [0, 1, 2, 3]):
        eng.generate([PROMPTS[i] for i in batch], [sampled[i] for i in batch])
        mixed = [greedy[i] if i % 2 else sampled[i] for i in batch]
        outs = eng.generate([PROMPTS[i] for i in batch], mixed)
        assert [o.token_ids for i, o in zip(batch, outs) if i % 2] == [want[i] for i in batch if i % 2]
    assert eng.drafter.paths["ahead"] > 0 and eng.adaptive.chosen
    assert graphs() == after  # nothing captured on first use
    assert eng.all_blocks_free()
    # penalized rows, greedy and sampled, at the largest budget: their rule's graphs were captured by the warm-up too
    # (one per bucket and layout, greedy or not), and the contexts they kept were dropped after it
    penalized = [key for key in rule.graphs if len(key) > 6]
    assert {key[-1] for key in penalized} == {False, True} and len({key[1] for key in penalized}) > 1
    controller, eng.adaptive = eng.adaptive, FixedBudget(max(o.nodes for o in eng.adaptive.options))
    for batch in ([0], [0, 1, 2], [0, 1, 2, 3]):
        params = [dataclasses.replace(sampled[i] if i % 2 else greedy[i], presence_penalty=0.5,
                                      repetition_penalty=1.1) for i in batch]
        assert all(o.error is None for o in eng.generate([PROMPTS[i] for i in batch], params))
    eng.adaptive = controller
    assert graphs() == after


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("proposer", [None, "ngram", "draft"])
def test_gpu_first_long_requests_compile_no_triton_kernel(tiny_factory, proposer):
    """On CUDA the warm-up at construction leaves nothing for the first requests to compile: prompts of up to
    3,000 tokens (long key ranges, where attention splits its keys and a second kernel combines the splits),
    greedy and sampled, with and without penalties, batched, compile no Triton kernel while they run."""
    from triton import knobs

    target = str(tiny_factory("long_target", max_position_embeddings=4096))
    draft = {None: None, "ngram": "ngram",
             "draft": str(tiny_factory("long_draft", seed=3, num_hidden_layers=1, max_position_embeddings=4096))}
    eng = SpecEngine(draft[proposer], target, SpecConfig(device="cuda", dtype="bfloat16", max_batch_size=8,
                                                         tree="chain:4", kv_memory_bytes=256 << 20))
    assert eng.plan.warm_up
    prompts = [[(5 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((3000, 2100, 1300, 700, 33))]
    compiled, previous = [], knobs.runtime.jit_post_compile_hook
    # each compile's kernel and specialisation (argument types, constexprs, alignment): what the warm-up missed
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw.get("repr") or kw.get("fn").name)
    try:
        penalties = dict(presence_penalty=0.5, repetition_penalty=1.1)
        for params in (SamplingParams(max_new_tokens=24, ignore_eos=True),
                       SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.7, top_p=0.9, seed=1),
                       SamplingParams(max_new_tokens=24, ignore_eos=True, **penalties),
                       [SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.7, top_p=0.9, seed=i,
                                       **penalties) if i % 2 else SamplingParams(max_new_tokens=24, ignore_eos=True,
                                                                                 **penalties)
                        for i in range(len(prompts))]):
            assert all(o.error is None for o in eng.generate(prompts, params))
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    assert compiled == [], sorted(set(compiled))


@pytest.mark.parametrize("proposer", [None, "ngram"])
def test_rows_ending_across_buckets_capture_nothing_after_the_warm_up(setup, poisoning, proposer):  # noqa: F811
    """Target-only decoding and n-gram chains, pipelined, with stand-in graphs for every capture (those of
    ``test_graph_pools``, which also poison their pool's later outputs): a queued step's writer graph is keyed by
    its bucket and the bucket of the step it follows, so rows that end and leave fewer rows (8 -> 4 -> 2 -> 1, or
    several buckets at once) need the graph of that pair. After the warm-up, 24 requests of 1-40 new tokens
    through 8 rows (the row count crossing every bucket as they end) capture no graph at all; greedy output equals
    target-only decoding. (Without the warm-up's shrinking batches the pairs were captured here: three for
    target-only decoding, one for n-gram chains.)"""
    root, _, _ = setup
    target = load_model(root / "target")
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(24)]
    params = [SamplingParams(max_new_tokens=1 + (7 * i) % 40, ignore_eos=True) for i in range(len(prompts))]
    plain = SpecEngine(None, target, SpecConfig(num_blocks=600, block_size=8, max_batch_size=8))
    want = [o.token_ids for o in plain.generate(prompts, params)]
    cfg = SpecConfig(tree="chain:4", num_blocks=600, block_size=8, max_batch_size=8, cuda_graphs=True,
                     pipeline=True, adaptive=False, ngram_device=proposer == "ngram" or None, admit_min_free=1)
    eng = SpecEngine(proposer, target, cfg)
    eng.pipeline.hook.advance.capture = True  # (the writer as captured graphs, as on CUDA)
    if proposer == "ngram":
        eng.drafter.device_chains.capture = True  # (the follow-up too)
        eng.adaptive = make_controller(True, eng.drafter, None, epochs=True)  # CUDA: budgets by epochs
        eng.plan = dataclasses.replace(eng.plan, adaptive=True, budget_epochs=True)

    def captured() -> int:
        return sum(len(members) for members in poisoning.values())

    before = captured()
    assert eng.warm_up() > 0
    after = captured()
    assert after > before
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert captured() == after
    assert eng.pipeline.adopted > 0 and eng.all_blocks_free()
