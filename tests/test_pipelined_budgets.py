"""Pipelined n-gram steps under every node budget (``specdec/pipeline.py``, ``ChainAhead``): a step of budget n
verifies in the bucket of n + 1 queries and queues its successor there, chains cut to n tokens on the device
(n = 0: decode steps, with no follow-up behind them: the device histories catch up at the next budget), so a
pipelined engine gives an
unpipelined engine's tokens at that budget, greedy and seeded sampled rows mixed, with queued steps adopted; a
budget that changes every few steps drops the queued step at each change and still gives the same tokens.

On the CPU the padded (graph) steps run eagerly over the same buffers (``cuda_graphs=True``) on the tiny random
Llama; the cases are ``test_ngram_device``'s (eight requests through four rows, one stopped by a token)."""

from __future__ import annotations

import random

import pytest
import torch
from test_ngram_device import _checked_queued, _generated, _sampled_case

from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.pipeline import StepPipeline


def _engine(target, tree: str, pipeline: bool) -> SpecEngine:
    return SpecEngine("ngram", target, SpecConfig(tree=tree, num_blocks=256, block_size=8, max_batch_size=4,
                                                  prefix_cache=False, cuda_graphs=True, adaptive=False,
                                                  ngram_shared=False, ngram_device=True, pipeline=pipeline))


def _queued_shapes(monkeypatch) -> list[tuple[int, int]]:
    """Records (node budget, verify queries) of every step the pipeline queues."""
    shapes, queue = [], StepPipeline.queue

    def recorded(self, rows, step):
        queued = queue(self, rows, step)
        if queued is not None:
            shapes.append((queued.n, queued.key[2]))
        return queued

    monkeypatch.setattr(StepPipeline, "queue", recorded)
    return shapes


class ScriptedBudget:
    """A budget controller that holds each budget of ``script`` for ``every`` steps, in turn."""

    timing_valid = True

    def __init__(self, script: list[int], every: int) -> None:
        self.script, self.every, self.steps = script, every, 0

    def speculate(self, rows: list, proposer, verifier) -> list:
        proposer.budget = self.script[self.steps // self.every % len(self.script)]
        self.steps += 1
        return verifier.verify_proposal(rows, proposer.propose(rows))

    def observe_step(self, seconds: float) -> None:
        """Nothing to learn."""


@pytest.mark.parametrize("tree,budget", [("chain:8", 0), ("chain:8", 1), ("chain:8", 3), ("chain:8", 8),
                                         ("chain:4", 2)])
def test_every_budget_is_pipelined(tiny_target, monkeypatch, tree, budget):
    """At budget n (chain:4's 2 leaves its bucket of 4 queries a query to spare): greedy and sampled (T=0.7 top-p
    0.9, T=1.0) rows give the unpipelined engine's tokens at n (greedy rows target-only's), and so does a batch of
    the sampled rows alone; every queued step is built under n in the bucket of n + 1 queries, most steps are adopted,
    and every adopted step's inputs are what the host packs for the chains the drafter proposes under n."""
    prompts, params, ref = _sampled_case(tiny_target)
    checked, wrong, _ = _checked_queued(monkeypatch)
    shapes = _queued_shapes(monkeypatch)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    outs = {}
    for pipeline in (False, True):
        eng = _engine(tiny_target, tree, pipeline)
        eng.drafter.budget = budget
        outs[pipeline] = _generated(eng, prompts, params)
        outs[pipeline, "sampled"] = _generated(eng, [prompts[i] for i in sampled], [params[i] for i in sampled])
        assert wrong == [], wrong[:2]
        assert eng.all_blocks_free()
    pipe, follow = eng.pipeline, eng.verifier.followup
    assert outs[True] == outs[False] and outs[True, "sampled"] == outs[False, "sampled"]
    assert [outs[True][i] for i in range(len(ref)) if i not in sampled] == [
        ref[i] for i in range(len(ref)) if i not in sampled]
    assert pipe.adopted == checked[0] > follow.launches // 2  # (a follow-up behind every verify)
    assert pipe.queued - pipe.adopted - pipe.dropped in (0, 1)  # (the last step's successor is left queued)
    assert set(shapes) == {(budget, {3: 4}.get(budget + 1, budget + 1))}
    assert bool(follow.chains) == (budget > 0)  # (budget 0: no follow-up looks a chain up)


def test_a_budget_changing_every_few_steps(tiny_target, monkeypatch):
    """Budgets 8, 0, 3, 1, 2 of chain:8, each held for three steps: pipelined tokens equal unpipelined ones under the
    same script (greedy rows target-only's); each change drops the step queued under the budget before, and steps
    queued under the one held are adopted."""
    prompts, params, ref = _sampled_case(tiny_target)
    checked, wrong, _ = _checked_queued(monkeypatch)
    shapes = _queued_shapes(monkeypatch)
    outs = {}
    for pipeline in (False, True):
        eng = _engine(tiny_target, "chain:8", pipeline)
        eng.adaptive = ScriptedBudget([8, 0, 3, 1, 2], every=3)
        outs[pipeline] = _generated(eng, prompts, params)
        assert wrong == [], wrong[:2]
        assert eng.all_blocks_free()
    pipe = eng.pipeline
    assert outs[True] == outs[False]
    assert [outs[True][i] for i, p in enumerate(params) if p.greedy] == [ref[i] for i, p in enumerate(params)
                                                                         if p.greedy]
    assert pipe.adopted == checked[0] > eng.verifier.followup.launches // 3 and pipe.dropped > 4
    assert {n for n, _ in shapes} == {8, 0, 3, 1, 2} and {q for _, q in shapes} == {9, 1, 4, 2}


def _gpu_case(tiny_dirs, seed: int):
    """The tiny target in float32 on CUDA, 24 requests (a third greedy, the rest seeded at T=0.7 top-p 0.9 or T=1.0)
    and the SpecConfig fields of a graphed n-gram engine of 16 rows with device chains."""
    from specdec.loading.registry import load_model

    target = load_model(tiny_dirs["llama"], device="cuda")
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 40) for _ in range(rng.randrange(6, 40))] * 2 for _ in range(24)]
    params = [SamplingParams(max_new_tokens=rng.randrange(30, 60), ignore_eos=True, seed=i,
                             **({} if i % 3 else dict(temperature=0.7, top_p=0.9) if i % 2 else dict(temperature=1.0)))
              for i in range(len(prompts))]
    base = dict(tree="chain:8", num_blocks=1024, block_size=16, prefix_cache=False, device="cuda", max_batch_size=16,
                admit_min_free=1, cuda_graphs=True, adaptive=False, ngram_shared=False, ngram_device=True)
    return target, prompts, params, base


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_budgets_with_captured_graphs(tiny_dirs):
    """float32 on CUDA, graphs captured, 16 rows of which a third seeded and sampled: budgets 8, 0, 3, 1 of chain:8
    held four steps each give the unpipelined engine's tokens under the same script, queued steps are adopted under
    each budget, and their inputs are written by a graph per bucket (1, 2, 4 and 9 queries) reading the follow-up
    graph's output."""
    target, prompts, params, base = _gpu_case(tiny_dirs, 11)
    outs = {}
    for pipeline in (False, True):
        eng = SpecEngine("ngram", target, SpecConfig(pipeline=pipeline, **base))
        eng.adaptive = ScriptedBudget([8, 0, 3, 1], every=4)
        outs[pipeline] = _generated(eng, prompts, params)
        assert eng.all_blocks_free()
    pipe = eng.pipeline
    assert outs[True] == outs[False]
    assert pipe.adopted > eng.verifier.followup.launches // 3 and pipe.dropped > 0
    assert {key[0][2] for key in pipe.hook.advance.graphs} == {1, 2, 4, 9}


def _recorded(free_chain, looked: list):
    """``free_chain``, each call's (request, its length, the chain) appended to ``looked``."""
    def look(req, k: int) -> list[int]:
        looked.append((req, len(req.tokens), free_chain(req, k)))
        return looked[-1][2]
    return look


def test_free_chains_watched_at_plain_decoding_change_no_token(tiny_target):
    """The n-gram engine's epoch controller looks its rows' chains up on the host while it holds plain decoding
    (``EpochBudget.watch``): the tokens are those of the same controller without free chains (greedy rows
    target-only's, seeded sampled rows the same draws), and every chain looked up is counted, once its row's tokens
    are known, as its longest prefix equal to the tokens the row went on to commit (recomputed here from the
    finished requests), cut to each budget."""
    from specdec.budget_policy import EpochBudget, EpochConfig, make_controller

    prompts, params, ref = _sampled_case(tiny_target)
    outs, ctrls, looked = {}, {}, []
    for free in (False, True):
        eng = _engine(tiny_target, "chain:8", True)
        ctrl = ctrls[free] = make_controller(True, eng.drafter, None, epochs=True)
        assert isinstance(ctrl, EpochBudget) and ctrl.shadow is not None
        ctrl.shadow = _recorded(eng.drafter.free_chain, looked) if free else None
        # held at plain decoding: the search's speculating budgets cost far more than they commit
        ctrl.config = EpochConfig(epoch_steps=2, epoch_rows=0, first_row_steps=0, hold_epochs=2, max_hold_epochs=2,
                                  plain_margin=10.0, shadow_rows=4, shadow_min_rows=4)
        eng.adaptive = ctrl
        outs[free] = _generated(eng, prompts, params)
        assert eng.all_blocks_free()
    assert outs[True] == outs[False]
    assert [outs[True][i] for i, p in enumerate(params) if p.greedy] == [ref[i] for i, p in enumerate(params)
                                                                         if p.greedy]
    want = [0] * (len(ctrl.options) + 1)
    for req, length, chain in looked:
        done = req.tokens[length:length + len(chain)]
        prefix = next((i for i, (a, b) in enumerate(zip(chain, done)) if a != b), min(len(chain), len(done)))
        want = [want[0] + 1] + [w + 1 + min(prefix, o.nodes) for w, o in zip(want[1:], ctrl.options)]
    got = [sum(col) for col in zip(*(s.shadow for s in ctrls[True].states.values()))]
    assert len(looked) > 8 and got == want
    assert all(s.shadow[0] == 0 for s in ctrls[False].states.values())
