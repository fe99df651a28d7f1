"""The EAGLE drafter's batch bookkeeping: the target features kept in the pool's slots, and the device program's
step at a full batch of 64 rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.registry import LoadedModel
from specdec.models.eagle import EagleShape, default_aux_layers, eagle_from_target
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("device", ["cpu"] + ["cuda"] * torch.cuda.is_available())
def test_pool_features_live_in_their_slots_and_move_with_the_kv(device):
    """The pool keeps each slot's target features: written per slot (a padding query's slot -1 writes nowhere that
    is read), read by position through a block table (the zero row before position 0 and for a released block),
    and moved with the KV when an accepted path is adopted (one kernel launch on CUDA, the same result)."""
    from specdec.kvcache.pool import KVPool, KVSpec

    pool = KVPool([KVSpec(2, 1, 4), KVSpec(1, 1, 4)], block_size=4, num_blocks=6, device=device, feature_width=3)
    assert pool.features.shape == (6 * 4 + 2, 3) and pool.feature_zero == 24
    sized = KVPool([KVSpec(2, 1, 4)], block_size=4, memory_bytes=10 * (2 * 2 * 4 * 4 + 4 * 3) * 4, feature_width=3)
    assert sized.num_blocks == 10  # a block's features count against the memory budget
    slots = torch.tensor([5, 6, 7, -1, 12], device=device)
    feats = torch.arange(15.0, device=device).view(5, 3) + 1
    pool.store_features(slots, feats)
    assert not pool.features[pool.feature_zero].any()
    table = np.array([[1, 3, -1], [1, 3, 0]])  # two requests sharing block 1, the first's third released
    rows = pool.feature_rows(table, np.array([[-1, 1, 2, 8], [0, 1, 2, 3]]))
    assert rows.tolist() == [[24, 5, 6, 24], [4, 5, 6, 7]]
    on_device = pool.feature_rows_on_device(torch.tensor(table, device=device),
                                            torch.tensor([[-1, 1, 2, 8], [0, 1, 2, 3]], device=device))
    assert on_device.tolist() == rows.tolist()  # (the twin a captured forward computes)
    torch.testing.assert_close(pool.features[torch.from_numpy(rows[0]).to(device)][1:3], feats[:2])
    k, v = pool.layer_kv(0, 1)
    k[3, 0] = 9.0  # slot 12's K in one layer
    pool.move_slots(torch.tensor([12, 7], device=device), torch.tensor([5, 6], device=device))
    torch.testing.assert_close(pool.features[5], feats[4])
    torch.testing.assert_close(pool.features[6], feats[2])
    assert (k[1, 1] == 9.0).all()  # slot 5 = block 1, offset 1


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


def test_long_draft_forwards_run_as_graphed_pieces(tiny_target, monkeypatch):
    """With padded steps, an EAGLE draft's forwards over rows longer than its graphs take (a catch-up of a draft
    that fell 70 positions behind in plain-decoding steps, more than a replay's worth of pieces) run as pieces
    through its graph buckets, with the hidden states an eager forward over whole rows gives; the output equals
    target-only decoding."""
    from specdec.runner import ModelRunner

    shape = EagleShape(default_aux_layers(tiny_target.config.num_layers), 64)
    model = eagle_from_target(tiny_target.model, shape, torch.arange(0, 256, 4), seed=5).eval().requires_grad_(False)
    draft = LoadedModel("eagle", model, None, model.config)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (150, 7, 30, 40)]
    params = SamplingParams(max_new_tokens=80, ignore_eos=True)
    cfg = dict(num_blocks=512, block_size=8, max_batch_size=16)  # (graph batch buckets up to 16: several replays)
    want = [o.token_ids for o in SpecEngine(None, tiny_target, SpecConfig(**cfg)).generate(prompts, params)]
    eng = SpecEngine(draft, tiny_target, SpecConfig(tree="dynamic:16", cuda_graphs=True, adaptive=False,
                                                    pipeline=False, **cfg))
    pieces, checked = ModelRunner._graphed_pieces, []

    def both(self, model_idx, rows, feats):
        out = pieces(self, model_idx, rows, feats)
        if out is not None and max(len(r.token_ids) for r in rows) > 64:
            ctx, ids, pos = self.prepare(model_idx, rows)
            with torch.inference_mode():
                eager = eng.draft.model(ids, pos, ctx, feats)
            torch.testing.assert_close(out[0], eager, rtol=1e-4, atol=1e-4)
            checked.append(len(rows))
        return out

    monkeypatch.setattr(ModelRunner, "_graphed_pieces", both)
    steps, step = iter(range(10**6)), eng.step

    def plain_first():  # 70 steps of plain decoding (the draft does not run), then speculation
        eng.drafter.budget = 0 if next(steps) < 71 else None
        return step()

    eng.step = plain_first
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert checked == [4] and eng.drafter.paths["behind"] == 1
    assert eng.all_blocks_free()


@pytest.mark.parametrize("device", ["cpu"] + ["cuda"] * torch.cuda.is_available())
@pytest.mark.parametrize("kind", ["eagle", "llama"])
def test_prefill_pieces_write_the_draft_kv_its_own_forward_would(tiny_dirs, kind, device, monkeypatch):
    """With padded steps (captured graphs on CUDA), each prefill replay runs the draft model over its pieces right
    after the target (an EAGLE draft reading the features of the position before each, found through the block
    tables; a chunk that starts mid-prompt reads the earlier chunk's): the draft's KV of every prompt position
    equals what the draft's own forward over the prompt writes in an engine without graphs (float32), and the
    drafter's own prefill never runs."""
    from specdec.loading.registry import load_model

    tiny_target = load_model(tiny_dirs["llama"], device=device)
    if kind == "eagle":
        shape = EagleShape(default_aux_layers(tiny_target.config.num_layers), 64)
        model = eagle_from_target(tiny_target.model, shape, torch.arange(0, 256, 4), seed=5)
        draft = LoadedModel("eagle", model.eval().requires_grad_(False), None, model.config)
    else:
        draft = load_model(tiny_dirs["llama_draft"], device=device)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (150, 7, 64, 65)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)  # (none ends before every prompt is prefilled)
    # chunks of at most 100 tokens: the 150-token prompt's second starts at 100
    cfg = dict(num_blocks=256, block_size=8, max_batch_size=4, prefix_cache=False, adaptive=False, pipeline=False,
               max_num_tokens=100, device=device)
    kv = {}
    for graphed in (True, False):
        eng = SpecEngine(draft, tiny_target, SpecConfig(tree="chain:3", cuda_graphs=graphed, **cfg))
        if graphed:
            monkeypatch.setattr(eng.drafter, "prefill", lambda chunks: pytest.fail("the drafter's own prefill ran"))
        reqs = [eng.add_request(p, params) for p in prompts]
        while any(r.num_computed < len(p) for r, p in zip(reqs, prompts)):
            eng.step()  # (decode steps write KV only past the prompt)
        assert all(r.num_computed_draft >= len(p) for r, p in zip(reqs, prompts))
        k, v = eng.pool.layer_kv(1, 0)
        bs = eng.pool.block_size
        slots = [torch.tensor([r.blocks[i // bs] * bs + i % bs for i in range(len(p))], device=device)
                 for r, p in zip(reqs, prompts)]
        kv[graphed] = [(k.flatten(0, 1)[s], v.flatten(0, 1)[s]) for s in slots]
    for (kg, vg), (ke, ve) in zip(kv[True], kv[False]):
        assert ke.abs().sum() > 0
        torch.testing.assert_close(kg, ke, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(vg, ve, rtol=1e-4, atol=1e-4)
