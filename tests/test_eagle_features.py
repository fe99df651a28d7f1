"""The EAGLE drafter's batch bookkeeping: the feature table every running request's features wait in, and
the device program's step at a full batch of 64 rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.drafters.eagle_drafter import FeatureTable
from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.registry import LoadedModel
from specdec.sampling_params import SamplingParams
from specdec.training.eagle import EagleShape, default_aux_layers, eagle_from_target

pytestmark = pytest.mark.usefixtures("single_thread")


class _Req:
    def __init__(self, bt_row: int) -> None:
        self.bt_row = bt_row


def _read(table: FeatureTable, reqs, begins, width: int) -> torch.Tensor:
    """(R, width, k*H) features of draft positions begins[i] + j (all columns valid)."""
    bt = np.array([r.bt_row for r in reqs])
    rows = table.sources(reqs, bt, np.array(begins), np.ones((len(reqs), width), dtype=bool))
    return table.gather(rows.ravel()).view(len(reqs), width, -1)


def test_feature_table_reads_what_each_request_stored_and_zeros_elsewhere():
    table = FeatureTable(rows=4, cap=3, width=2, dtype=torch.float32, device="cpu")
    a, b = _Req(0), _Req(3)
    fa = torch.arange(6.0).view(3, 2) + 1  # positions 10, 11, 12 of a
    fb = torch.full((1, 2), 7.0)  # position 4 of b
    table.store([a, b], [10, 4], [fa, fb])
    got = _read(table, [a, b], [11, 4], 3)  # a: positions 10..12; b: positions 3..5 (only 4 known)
    torch.testing.assert_close(got[0], fa)
    torch.testing.assert_close(got[1], torch.tensor([[0.0, 0.0], [7.0, 7.0], [0.0, 0.0]]))
    stranger = _Req(0)  # a later request on a's block-table row never reads a's features
    assert _read(table, [stranger], [11], 3).abs().sum() == 0
    table.consumed(np.array([0]), np.array([13]))  # a's draft reached position 13: nothing left to read
    assert _read(table, [a], [11], 3).abs().sum() == 0
    with pytest.raises(ValueError, match="at most 3 feature rows"):
        table.store([a], [0], [torch.zeros(4, 2)])


def test_full_batch_of_64_rows_stays_on_the_device_program(tiny_target):
    """64 greedy rows of a static tree: every step is drafted by the device program (catch-up features from
    the feature table), and the output equals target-only decoding."""
    shape = EagleShape(default_aux_layers(tiny_target.config.num_layers), 64)
    vocab = torch.arange(0, 256, 4)
    model = eagle_from_target(tiny_target.model, shape, vocab, seed=3).eval().requires_grad_(False)
    draft = LoadedModel("eagle", model, None, model.config)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(2, 30, (64,), generator=g)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    cfg = dict(num_blocks=1024, block_size=8, max_batch_size=64)
    want = [o.token_ids for o in SpecEngine(None, tiny_target, SpecConfig(**cfg)).generate(prompts, params)]
    eng = SpecEngine(draft, tiny_target, SpecConfig(tree="topk:2x2", cuda_graphs=True, **cfg))
    buckets, run = [], eng.drafter.device_loop.run
    eng.drafter.device_loop.run = lambda b, *a: buckets.append(b) or run(b, *a)
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert max(buckets) == 64
    assert eng.drafter.paths["device"] > 0 and eng.drafter.paths["host"] == 0
    assert eng.all_blocks_free()
