"""The EAGLE device program cut to a node budget (``DeviceDraftProgram.variant_for``): under budget n it runs only
the levels that hold the n nodes a step keeps, a dynamic tree's levels only as wide as they must be to hold them,
and at budget 0 the catch-up forward alone. The kept trees equal
the whole program's, the draft KV of the catch-up equals the whole program's (so later steps draft from the same
state), and a budget-0 program writes no other KV; through the engine, budgets changing every few steps give
target-only's tokens, greedy and seeded sampled, pipelined or not, with each cut program run.

The target is the 4-layer random Llama of ``test_eagle`` with its briefly trained EAGLE draft, float32; on the CPU
the padded graph steps run eagerly over the same buffers (``cuda_graphs=True``), on CUDA (``[cuda]``) every cut of
the program is a captured graph."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from test_eagle import DEVICES, PROMPTS, setup, trained_pair  # noqa: F401 - setup: the trained tiny draft, a fixture
from test_pipelined_budgets import ScriptedBudget

from specdec.adaptive import budget_options
from specdec.drafters.eagle_device import DeviceDraftProgram
from specdec.drafters.eagle_drafter import DRAFT_MODEL_INDEX, _Spans
from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams
from specdec.tree_writer import best_nodes_on_device

pytestmark = pytest.mark.usefixtures("single_thread")

CFG = dict(num_blocks=200, block_size=8, max_batch_size=4, cuda_graphs=True, adaptive=False, prefix_cache=False)
# two greedy rows, two seeded sampled ones (T=0.7 top-p 0.9, T=1.0), ending at different steps
PARAMS = [SamplingParams(max_new_tokens=n, ignore_eos=True, seed=i, **kw) for i, (n, kw) in enumerate(
    [(23, {}), (12, dict(temperature=0.7, top_p=0.9)), (17, {}), (30, dict(temperature=1.0))])]


@pytest.fixture(scope="module", params=DEVICES)
def pair(setup, request):  # noqa: F811 - the fixture imported above
    return *trained_pair(setup, request.param, PARAMS), request.param


def _levels_run(monkeypatch) -> list[tuple[int, int | None]]:
    """Records the (levels, width) of every draft program run (eagerly on the CPU: each run is a ``_program``
    call)."""
    runs, program = [], DeviceDraftProgram._program

    def recorded(self, b, sampled, levels, width):
        runs.append((levels, width))
        return program(self, b, sampled, levels, width)

    monkeypatch.setattr(DeviceDraftProgram, "_program", recorded)
    return runs


TRITON_ON_CPU = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                   reason="the interpreter runs Triton on the CPU; on CUDA the auto backend is Triton")


@pytest.mark.parametrize("tree,backend", [("dynamic:16", "auto"), ("topk:2x3", "auto"),
                                          pytest.param("dynamic:12:4x4", "triton", marks=TRITON_ON_CPU)])
def test_cut_programs_keep_the_whole_programs_trees_and_catch_up_kv(pair, monkeypatch, tree, backend):
    """At the first decode step of four rows (two sampled), each budget's cut program, run from the same KV and
    inputs as the whole program, keeps the same trees (greedy and sampled variants) and writes the same draft KV at
    the catch-up slots; no program is captured for budget 0 (its steps run no draft), and asked for one the whole
    program runs. (Then the step runs on from the KV as it was, and the tokens are target-only's.)"""
    draft, target, want, dev = pair
    if backend == "triton" and dev != "cpu":
        pytest.skip("the interpreter runs on the CPU (on CUDA the auto backend is Triton)")
    eng = SpecEngine(draft, target, SpecConfig(tree=tree, pipeline=False, device=dev, attention_backend=backend,
                                               **CFG))
    d, loop, pool = eng.drafter, eng.drafter.device_loop, eng.pool
    budgets = sorted({o.nodes for o in budget_options(d)})
    assert len(budgets) > 2 and 0 in budgets
    assert set(loop.variants) == {loop.variant_for(n) for n in budgets if n} | {loop.variant_for(None)}
    assert loop.levels_for(0) == 0 and loop.levels_for(max(budgets)) == loop.max_levels
    assert 0 < loop.levels_for(1) < loop.max_levels
    if tree == "dynamic:16":  # narrower levels for budgets below the width
        assert loop.max_width == 10 and loop.width_for(1) == 1 and loop.width_for(7) == 7
        assert loop.variant_for(3) == (3, 3) and loop.variant_for(7) == (5, 7) and loop.variant_for(15) == (5, 10)
    elif tree.startswith("dynamic"):
        assert [loop.variant_for(n) for n in (1, 3, 7, 12)] == [(1, 1), (3, 3), (4, 4), (4, 4)]
    else:
        assert loop.max_width is None and {w for _, w in loop.variants} == {None}
    checked, propose = [], d.propose

    def check(rows) -> None:
        spans = _Spans.of(rows, loop.q)
        packed, bt, src = d._catch_up_rows(rows, spans, loop.q)
        b = loop.bucket(len(rows), int((spans.ends - spans.begins).max()))
        padded = np.full(b * loop.q, d.features.zero, dtype=np.int64)
        padded[:src.size] = src.ravel()
        src = torch.from_numpy(padded).to(dev)
        catch_up = torch.from_numpy(packed.tokens[2]).to(dev)  # (T,) the catch-up's KV slots
        before = pool.storage.clone()

        def run(sampled: bool, n: int | None):
            pool.storage.copy_(before)
            out = loop.run(b, packed, bt, d.features.data, src, sampled, n)[:len(rows)].clone()
            kv = [torch.stack([t.flatten(0, 1)[catch_up] for t in layer]) for layer in pool.model_kv(DRAFT_MODEL_INDEX)]
            return out, torch.stack(kv), pool.storage.clone()

        def kept(out, n: int):
            if out.dim() == 3:  # a dynamic tree: (R, 3, N) tokens, parents, ranks
                return [t.tolist() for t in best_nodes_on_device(out, n)]
            return out[:, :n].tolist()  # a static template's first n nodes

        for sampled in (False, loop.set_rows(rows)):
            whole, whole_kv, _ = run(sampled, None)
            for n in budgets if backend != "triton" else (1, 3):  # (interpreted: the narrow cuts alone)
                out, kv, _ = run(sampled, n)
                assert kept(out, n) == kept(whole, n), (sampled, n)
                assert torch.equal(kv, whole_kv), (sampled, n)
        pool.storage.copy_(before)
        checked.append(sampled)

    def probe(rows):
        if not checked and len(rows) == 4:
            check(rows)
        return propose(rows)

    monkeypatch.setattr(d, "propose", probe)
    params = PARAMS
    if backend == "triton":  # (interpreted: a few tokens, enough for the first decode step of all four rows)
        params = [dataclasses.replace(p, max_new_tokens=3) for p in PARAMS]
        want = [o.token_ids for o in SpecEngine(None, target, SpecConfig(device=dev, **CFG)).generate(PROMPTS[:4],
                                                                                                    params)]
    outs = eng.generate(PROMPTS[:4], params)
    assert checked == [True]  # (two rows sample)
    assert [o.token_ids for o in outs] == want


@pytest.mark.parametrize("pipeline", [False, True])
def test_budgets_changing_every_few_steps_give_target_only_tokens(pair, monkeypatch, pipeline):
    """Budgets full, 0, 1, 3, 0, 7 of dynamic:16, each held three steps, greedy and seeded sampled rows mixed:
    every row's tokens are target-only's (the sampled rule's choices depend on no proposal), each cut of the
    program runs, and steps at budget 0 run no draft (plain decoding; the draft catches up at the next budget)."""
    draft, target, want, dev = pair
    runs = _levels_run(monkeypatch)
    eng = SpecEngine(draft, target, SpecConfig(tree="dynamic:16", pipeline=pipeline, device=dev, **CFG))
    loop = eng.drafter.device_loop
    runs.clear()  # (CUDA: the captures at construction ran each program once)
    eng.adaptive = ScriptedBudget([16, 0, 1, 3, 0, 7], every=3)
    outs = eng.generate(PROMPTS[:4], PARAMS)
    assert [o.error for o in outs] == [None] * 4
    assert [o.token_ids for o in outs] == want
    if dev == "cuda":  # every cut of the program is a captured graph, replayed (no eager run)
        assert set(loop.graphs) >= {(1, False, *loop.variant_for(n)) for n in (16, 1, 3, 7)}
        assert runs == []
    else:
        assert {loop.variant_for(n) for n in (16, 1, 3, 7)} <= set(runs)
        assert not any(levels == 0 for levels, _ in runs)
    assert eng.drafter.paths["decode"] >= 3
    assert eng.all_blocks_free()
    if pipeline:
        assert eng.pipeline.adopted > 5

