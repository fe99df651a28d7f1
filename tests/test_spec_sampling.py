"""Seeded speculative sampling is reproducible: across batch composition, engines and preemption.

The distribution tests (chi-square against the exact target) live in tests/test_sampling_power.py;
the exact accept-rule checks in tests/test_acceptance.py.
"""

from __future__ import annotations

import pytest
import torch

from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------- seeded reproducibility


@pytest.mark.parametrize("tree", ["chain:2", "topk:2x2", "dynamic:8"])
def test_seed_reproducible_across_batch_composition(tiny_target, tiny_draft, tree):
    prompt = [17, 4, 99, 23, 5, 61, 8]
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_new_tokens=20, ignore_eos=True)

    def engine(**kw):
        return SpecEngine(tiny_draft, tiny_target, SpecConfig(tree=tree, num_blocks=256, block_size=8, **kw))

    alone = engine().generate([prompt], mine)[0].token_ids
    assert len(alone) == 20
    others = [[3, 4, 5], prompt, list(range(40, 80)), prompt, [9] * 12]
    params = [SamplingParams(temperature=0.8, seed=1, max_new_tokens=25, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.95, seed=43, max_new_tokens=20, ignore_eos=True),
              SamplingParams(max_new_tokens=15),
              mine,
              SamplingParams(temperature=1.3, top_k=20, seed=7, max_new_tokens=30, ignore_eos=True)]
    eng = engine()
    batch = eng.generate(others, params)
    assert batch[3].token_ids == alone
    assert batch[1].token_ids != alone  # another seed gives another sample
    one_by_one = engine(max_batch_size=1).generate(others, params)
    assert [o.token_ids for o in one_by_one] == [o.token_ids for o in batch]
    again = eng.generate([prompt], mine)[0]  # same engine, prefix now cached
    assert again.token_ids == alone
    assert eng.stats.accepted > 0
    assert eng.all_blocks_free()


def test_seeded_sampling_unchanged_by_preemption(tiny_target, tiny_draft):
    """Preemption recomputes a request's KV from its tokens; its random stream continues unchanged."""
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 256, (15 + 3 * i,), generator=g).tolist() for i in range(10)]
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_new_tokens=20, ignore_eos=True)
              for i in range(10)]
    roomy = SpecEngine(tiny_draft, tiny_target, SpecConfig(tree="chain:4", num_blocks=512, block_size=4))
    expect = [o.token_ids for o in roomy.generate(prompts, params)]
    tight = SpecEngine(tiny_draft, tiny_target, SpecConfig(tree="chain:4", num_blocks=26, block_size=4,
                                                           policy="max_utilization"))
    preempted = []
    preempt = tight.scheduler.preempt
    tight.scheduler.preempt = lambda req: (preempted.append(req.request_id), preempt(req))
    outs = tight.generate(prompts, params)
    assert preempted
    assert [o.token_ids for o in outs] == expect
    assert tight.all_blocks_free()
