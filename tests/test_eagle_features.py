"""The EAGLE drafter's batch bookkeeping: the feature table every running request's features wait in, and
the device program's step at a full batch of 64 rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.drafters.eagle_drafter import FeatureTable
from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.registry import LoadedModel
from specdec.models.eagle import EagleShape, default_aux_layers, eagle_from_target
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")


class _Req:
    def __init__(self, bt_row: int, blocks: tuple[int, ...] = ()) -> None:
        self.bt_row, self.blocks = bt_row, list(blocks)


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


def test_feature_table_keeps_the_last_position_of_each_prefilled_block():
    """A prefill keeps the features of each block's last position; a request that holds that block but not
    the features (a prefix hit) reads them there, at a block's last position only."""
    table = FeatureTable(rows=2, cap=3, width=2, dtype=torch.float32, device="cpu", blocks=6, block_size=4)
    computed = _Req(0, (5, 2, 0))
    feats = torch.arange(2.0, 10.0).repeat_interleave(2).view(8, 2)  # positions 2..9, row = its position
    table.keep_block_ends([computed], [2], [feats])  # keeps positions 3 (block 5) and 7 (block 2)
    hit = _Req(1, (5, 2, 4))  # the first two blocks from the prefix cache
    got = _read(table, [hit], [4], 5)  # positions 3..7
    torch.testing.assert_close(got[0, :, 0], torch.tensor([3.0, 0.0, 0.0, 0.0, 7.0]))
    assert _read(table, [_Req(1, (-1, 2))], [4], 1).abs().sum() == 0  # a released block: nothing kept
    table.store([hit], [8], [torch.full((1, 2), 8.0)])  # the request's own run comes first
    torch.testing.assert_close(_read(table, [hit], [8], 2)[0, :, 0], torch.tensor([7.0, 8.0]))


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


def _drafter_on(table):
    """A stand-in EAGLE drafter over feature table ``table``: the methods that keep the verify's features."""
    from types import SimpleNamespace

    from specdec.drafters.eagle_drafter import EagleDrafter

    d = SimpleNamespace(features=table, _pending=None)
    for name in ("_flush", "_store_noted", "_consumed", "consumed_through", "accepted"):
        setattr(d, name, getattr(EagleDrafter, name).__get__(d))
    return d


def test_features_a_queued_step_read_are_stored_only_if_it_is_dropped():
    """A fused step whose successor is queued (its features in that step's catch-up inputs, ``in_order``) leaves
    the feature table alone: adopted, the successor read them (nothing stored; a row of the step that did not
    adopt it keeps its own); dropped, the next proposal or prefill stores them first, as an eager store would."""
    from types import SimpleNamespace

    from specdec.fused_step import FusedOutcome
    from specdec.runner import RowSlices
    from specdec.verifier import _from_fused

    g = torch.Generator().manual_seed(6)
    r, q, n = 5, 5, 4
    carried = RowSlices(torch.randn(r * q, 3, generator=g), [i * q for i in range(r)], [q] * r)  # path order
    paths = [[], [0], [1, 3], [0, 1, 2, 3], [2]]
    accept = np.zeros((r, q + 3), dtype=np.int64)
    for i, p in enumerate(paths):
        accept[i, :2 + len(p)] = [len(p), 7 + i, *(j + 1 for j in p)]
    accept[:, -1] = 1
    tokens = torch.randint(0, 50, (r, n), generator=g).numpy()

    def step(finished=()):
        reqs = [SimpleNamespace(params=SamplingParams(), request_id=str(i), bt_row=i + 1, finished=i in finished,
                                num_computed_draft=10 + i, tokens=[0] * (12 + i)) for i in range(r)]
        res = _from_fused(reqs, [frozenset()] * r, FusedOutcome(accept, tokens, np.full(r, 3), carried, in_order=True))
        return reqs, res

    def table():
        return FeatureTable(rows=7, cap=n + 1, width=3, dtype=torch.float32, device="cpu")

    want_rows = [carried.table[i * q:i * q + len(p) + 1] for i, p in enumerate(paths)]
    for finished in ((), (3,)):
        reqs, res = step(finished)
        assert res.features_source is not None and res._packed is None  # nothing gathered yet
        live = [i for i in range(r) if i not in finished]
        ref = table()
        ref.store([reqs[i] for i in live], [reqs[i].num_computed_draft - 1 for i in live], [want_rows[i] for i in live])
        dropped = _drafter_on(table())
        dropped.accepted(reqs, res)
        assert not dropped.features.data.any() and all(o is None for o in dropped.features.owner)
        dropped._flush()  # (what propose and prefill do first)
        torch.testing.assert_close(dropped.features.data, ref.data)
        assert dropped.features.owner == ref.owner and (dropped.features.count == ref.count).all()
        adopted = _drafter_on(table())
        adopted.accepted(reqs, res)
        adopted.consumed_through([reqs[i] for i in live])
        assert adopted._pending is None and not adopted.features.data.any()
        assert [req.num_computed_draft for req in reqs if not req.finished] == [len(req.tokens) for req in reqs
                                                                                 if not req.finished]
    reqs, res = step()
    partial = _drafter_on(table())
    partial.accepted(reqs, res)
    starts = [req.num_computed_draft - 1 for req in reqs]
    partial.consumed_through(reqs[:2])  # rows 2-4 did not adopt the queued step: theirs are stored
    ref = table()
    ref.store(reqs[2:], starts[2:], want_rows[2:])
    torch.testing.assert_close(partial.features.data, ref.data)
    assert partial.features.owner == ref.owner
    torch.testing.assert_close(res.packed_features, torch.cat(want_rows))  # gathered when asked for


def test_verify_features_are_gathered_packed_and_stored_as_per_row():
    """The verify results' features (the pending token's and the accepted path's, from padded rows) gathered
    in one packed tensor, from result lists and from a fused step's acceptance rows alike, equal each row's own
    slice; the drafter stores the packed tensor as per-row stores would (when rows finished: the others' rows)."""
    from types import SimpleNamespace

    from specdec.drafters.eagle_drafter import EagleDrafter
    from specdec.fused_step import FusedOutcome
    from specdec.runner import ForwardResult, RowSlices
    from specdec.verifier import Verifier, VerifyResult, VerifyResults, _from_fused

    g = torch.Generator().manual_seed(5)
    r, q, n = 6, 5, 4
    table = RowSlices(torch.randn(r * q, 3, generator=g), [i * q for i in range(r)], [n + 1] * r)
    paths = [[], [0], [1, 3], [0, 1, 2, 3], [2], [0, 2]]  # accepted node paths (node j is verify query 1 + j)
    tokens = torch.randint(0, 50, (r, n), generator=g).numpy()
    results = [VerifyResult(p, [int(tokens[i, j]) for j in p], 7 + i, n, 3, frozenset()) for i, p in enumerate(paths)]
    packed = Verifier._with_features(results, ForwardResult(None, None, table))
    accept = np.zeros((r, q + 3), dtype=np.int64)  # [m, bonus, path..., finite]
    for i, p in enumerate(paths):
        accept[i, :2 + len(p)] = [len(p), 7 + i, *(j + 1 for j in p)]
    accept[:, -1] = 1
    reqs = [SimpleNamespace(params=SamplingParams(), request_id=str(i), bt_row=(2 * i) % 7, finished=False,
                            num_computed_draft=10 + i) for i in range(r)]
    fused = _from_fused(reqs, [frozenset()] * r, FusedOutcome(accept, tokens, np.full(r, 3), table))
    for got in (packed, fused):
        assert isinstance(got, VerifyResults)
        assert list(got) == results
        want = [table.table[[i * q + j for j in [0, *(1 + a for a in p)]]] for i, p in enumerate(paths)]
        for i, w in enumerate(want):
            torch.testing.assert_close(got.row_features(i), w)
        torch.testing.assert_close(got.packed_features, torch.cat(want))
        assert got.feature_sizes.tolist() == [len(p) + 1 for p in paths]
    for finished in (set(), {2}, {0, 5}, set(range(r))):  # all rows live: the packed tensor is stored whole; some
        for i, req in enumerate(reqs):  # finished: the others' rows of it
            req.finished = i in finished
        table_ = FeatureTable(rows=7, cap=n + 1, width=3, dtype=torch.float32, device="cpu")
        EagleDrafter.accepted(_drafter_on(table_), reqs, packed)
        live = [i for i in range(r) if i not in finished]
        ref = FeatureTable(rows=7, cap=n + 1, width=3, dtype=torch.float32, device="cpu")
        if live:
            ref.store([reqs[i] for i in live], [reqs[i].num_computed_draft - 1 for i in live],
                      [packed.row_features(i) for i in live])
        torch.testing.assert_close(table_.data, ref.data)
        assert (table_.start == ref.start).all() and (table_.count == ref.count).all() and table_.owner == ref.owner
        assert sum(o is not None for o in table_.owner) == len(live)
