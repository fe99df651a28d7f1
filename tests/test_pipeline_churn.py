"""Pipelined steps under churn: requests arrive while others run (so rows join the queued steps), end at different
steps, and some are aborted mid-stream; every request that was not aborted equals target-only decoding. The
pipelined engines: EAGLE's fused steps, the n-gram drafter's device chains, and target-only decoding.

The engine is driven step by step (``add_request``, ``Scheduler.abort``, ``step``) by a seeded schedule: 20
requests over the five prompts of ``test_eagle`` (several alike, so the prefix cache shares their blocks), 2-39 new
tokens each, most ignoring EOS, 40% sampled with a seed (T=0.8, top-p 0.9: a seeded request's tokens are
target-only sampling's with that seed), four rows, a row admitted as soon as one is free. One run per proposer
also has every captured graph poisoning its memory pool's later outputs (``test_graph_pools.poisoning``), and
EAGLE's queued steps written by the Triton kernel (interpreted) and its trees by the tree writer's graphs (over
buckets partly live). EAGLE's fused steps once took joining rows into padding rows of verify K without their root's
mask and query count: the joined requests' tokens went wrong from the second on, here as on the H200.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
from specdec.kernels.advance import advance_rows_triton
from specdec.scheduler.request import RequestStatus
from test_eagle import setup  # noqa: F401 - the trained tiny draft, a fixture
from test_graph_pools import poisoning  # noqa: F401 - a fixture
from test_lookahead import PROMPTS, tiny  # noqa: F401 - the engine fixture

from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

_TARGET_ONLY: dict = {}


def _target_only(target, prompt, params: SamplingParams) -> list[int]:
    """Target-only output (one unpipelined engine without graphs, kept across tests)."""
    key = (id(target), repr(prompt), repr(params))
    if key not in _TARGET_ONLY:
        eng = _TARGET_ONLY.setdefault(("engine", id(target)), SpecEngine(None, target, SpecConfig(
            num_blocks=400, block_size=8, cuda_graphs=False, pipeline=False, adaptive=False, device=target.device)))
        _TARGET_ONLY[key] = eng.generate([prompt], params)[0].token_ids
    return _TARGET_ONLY[key]


@pytest.mark.parametrize("proposer", ["eagle", "ngram", "none"])
@pytest.mark.parametrize("seed", [0, 1])
def test_requests_arriving_ending_and_aborted_while_steps_are_queued(tiny, request, proposer, seed):  # noqa: F811
    draft, target, _, cfg = tiny
    if seed == 1 and cfg["device"] == "cpu":
        request.getfixturevalue("poisoning")
    rng = random.Random(seed)
    proposed = {"eagle": (draft, "dynamic:16", {}), "ngram": ("ngram", "chain:4", {"ngram_device": True}),
                "none": (None, "dynamic:16", {})}
    draft, tree, extra = proposed[proposer]
    eng = SpecEngine(draft, target, SpecConfig(
        tree=tree, **{**cfg, "max_batch_size": 4, "admit_min_free": 1, "prefix_cache": seed == 0, **extra}))
    if cfg["device"] == "cpu":
        eng.pipeline.hook.advance.capture = True  # (the queued-step writer as captured graphs, as on CUDA)
        if proposer == "eagle" and seed == 1:
            eng.verifier.fused.writer.capture = True  # (the tree writer's graphs too, over partly live buckets)
            if os.environ.get("TRITON_INTERPRET") == "1":
                eng.pipeline.hook.rows_op = advance_rows_triton  # (interpreted; on CUDA it runs compiled)
    reqs, aborted = [], set()
    while len(reqs) < 20 or eng.scheduler.has_work:
        if len(reqs) < 20 and rng.random() < 0.3:
            prompt = PROMPTS[rng.randrange(len(PROMPTS))]
            params = SamplingParams(max_new_tokens=rng.randrange(2, 40), ignore_eos=rng.random() < 0.7)
            if rng.random() < 0.4:  # seeded sampling: the same tokens as target-only sampling with that seed
                params = dataclasses.replace(params, temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 20))
            reqs.append((eng.add_request(prompt, params), prompt, params))
        running = [r for r, _, _ in reqs if r.status is RequestStatus.RUNNING and r.request_id not in aborted]
        if running and rng.random() < 0.03:
            victim = rng.choice(running)
            eng.scheduler.abort(victim)
            aborted.add(victim.request_id)
        eng.step()
    wrong = [(r.request_id, r.tokens[len(r.prompt_ids):]) for r, prompt, params in reqs
             if r.request_id not in aborted and r.tokens[len(r.prompt_ids):] != _target_only(target, prompt, params)]
    assert not wrong, wrong
    assert aborted and eng.pipeline.adopted > 0 and eng.all_blocks_free()
    assert eng.pipeline.joined > 0
    if proposer == "eagle" and seed == 1 and cfg["device"] == "cpu":  # (graphs over partly live buckets ran)
        assert eng.verifier.fused.writer.graphs
