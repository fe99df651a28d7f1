"""The EAGLE device program's sampled variant draws a sampled row's children at the request's temperature divided
by ``SAMPLED_DRAFT_SHARPNESS`` (S), coupled with the target's own draw: its per-row inputs hold S / T for sampled
rows and 0 for greedy ones, and S changes the trees a step verifies, never the tokens (seeded sampled rows give
target-only's tokens at every S: the rule takes the target's draw whatever is proposed).

The target is the 4-layer random Llama of ``test_eagle`` with its briefly trained EAGLE draft, float32, on the CPU
(the padded graph steps run eagerly)."""

from __future__ import annotations

import numpy as np
import pytest
from test_eagle import PROMPTS, setup, trained_pair  # noqa: F401 - setup: the trained tiny draft, a fixture

from specdec.drafters import eagle_device
from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

CFG = dict(num_blocks=200, block_size=8, max_batch_size=4, cuda_graphs=True, adaptive=False, prefix_cache=False,
           tree="dynamic:16")
PARAMS = [SamplingParams(max_new_tokens=20, ignore_eos=True, seed=7 + i, **kw) for i, kw in enumerate(
    [{}, dict(temperature=0.7, top_p=0.9), dict(temperature=1.0), dict(temperature=1.3, top_k=20)])]


def test_sharpness_moves_the_trees_and_not_the_tokens(setup, monkeypatch):  # noqa: F811 - the fixture imported above
    draft, target, want = trained_pair(setup, "cpu", PARAMS)
    trees, inputs = {}, {}
    for sharp in (1.0, eagle_device.SAMPLED_DRAFT_SHARPNESS):
        monkeypatch.setattr(eagle_device, "SAMPLED_DRAFT_SHARPNESS", sharp)
        eng = SpecEngine(draft, target, SpecConfig(**CFG))
        loop, verify, seen = eng.drafter.device_loop, eng.verifier.verify_proposal, trees.setdefault(sharp, [])

        def spy(rows, proposal, verify=verify, seen=seen, loop=loop, sharp=sharp):
            results = verify(rows, proposal)
            seen.append([t.host.tokens for t in proposal.trees])
            inputs.setdefault(sharp, loop.sampling[:len(rows), 2].cpu().numpy().view(np.float64).copy())
            return results

        eng.verifier.verify_proposal = spy
        got = eng.generate(PROMPTS[:4], PARAMS)
        assert [o.token_ids for o in got] == want, sharp  # target-only's tokens, greedy and seeded sampled
    for sharp, row in inputs.items():  # the program's inputs: S / T for a sampled row, 0 for a greedy one
        assert row.tolist() == pytest.approx([0.0, sharp / 0.7, sharp / 1.0, sharp / 1.3])
    assert eagle_device.SAMPLED_DRAFT_SHARPNESS > 1
    assert trees[1.0] != trees[eagle_device.SAMPLED_DRAFT_SHARPNESS]  # the sampled rows' children differ
