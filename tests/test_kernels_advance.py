"""``kernels/advance.py``: a pipelined step's integer inputs in one launch equal the torch reference
(``specdec.lookahead_ops.advance_rows_reference``), element by element, in both buckets' buffers and the returned
feature sources and KV moves. Under TRITON_INTERPRET=1 on the CPU; compiled on CUDA when present."""

from __future__ import annotations

import os

import pytest
import torch

from specdec.lookahead_ops import advance_rows_reference
from specdec.step_inputs import StepInputs

DEVICES = (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + (["cuda"] if torch.cuda.is_available()
                                                                           else [])
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs TRITON_INTERPRET=1 or CUDA")


def _state(g, dev, r, bv, qv, bp, qp, n, width, bs):
    """Random buckets (both filled with junk, then each row's pending token at a random L - 1), an outcome whose
    first m path lanes are increasing node queries (the rest the other lanes), trees and block tables."""
    verify, program = StepInputs(bv, qv, width, dev), StepInputs(bp, qp, width, dev)
    for inp in (verify, program):
        inp.dev.copy_(torch.randint(-5, 1000, inp.dev.shape, generator=g))
    L = torch.randint(1, (width - 4) * bs - qv - qp, (r,), generator=g)
    verify.views(bv, qv).positions.view(bv, qv)[:r, 0] = (L - 1).to(dev)
    accept = torch.zeros(r, qv + 3, dtype=torch.int64)
    depth = min(qp - 1, n)
    for i in range(r):
        m = int(torch.randint(0, depth + 1, (1,), generator=g))
        path = sorted(torch.randperm(n, generator=g)[:m].add(1).tolist())
        rest = [q for q in range(qv) if q not in path]
        accept[i] = torch.tensor([m, int(torch.randint(0, 500, (1,), generator=g)), *path, *rest, 1])
    tokens = torch.randint(0, 500, (r, n), generator=g)
    bt = torch.randint(0, 300, (r, width), generator=g)
    return verify, program, accept.to(dev), tokens.to(dev), bt.to(dev)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("r,bv,qv,bp,qp,n,static", [(1, 1, 32, 1, 8, 31, False), (3, 4, 16, 4, 8, 9, False),
                                                     (5, 8, 8, 8, 16, 7, True), (2, 2, 64, 2, 16, 63, False),
                                                     (4, 4, 8, 4, 4, 3, True)])
def test_advance_rows_equals_the_reference(dev, r, bv, qv, bp, qp, n, static):
    from specdec.kernels.advance import advance_rows_triton

    g = torch.Generator().manual_seed(r * 100 + qv + qp + n)
    width, bs = 24, 8
    for _ in range(3):
        verify, program, accept, tokens, bt = _state(g, dev, r, bv, qv, bp, qp, n, width, bs)
        offsets = torch.randint(0, 9, (n + 1,), generator=g).to(dev) if static else None
        got_v, got_p = StepInputs(bv, qv, width, dev), StepInputs(bp, qp, width, dev)
        got_v.dev.copy_(verify.dev)
        got_p.dev.copy_(program.dev)
        want = advance_rows_reference(verify.views(bv, qv), bv, qv, accept, tokens, bt, program.views(bp, qp), bp, qp,
                                      bs, n, offsets)
        got = advance_rows_triton(got_v.views(bv, qv), bv, qv, accept, tokens, bt, got_p.views(bp, qp), bp, qp, bs,
                                  n, offsets)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert torch.equal(got_v.dev, verify.dev) and torch.equal(got_p.dev, program.dev)
        assert (want[1] >= 0).any() or not accept[:, 0].any()  # some path moved (unless nothing was accepted)


def _assert_padding(inputs: StepInputs, b: int, q: int, r: int) -> None:
    """Rows r.. of bucket (b, q) are padding as a host fill leaves it, and its query start locations are those of r
    live rows."""
    v = inputs.views(b, q)
    for name, pad in (("ids", 0), ("positions", 0), ("slots", -1), ("tree_mask", 0), ("parents", -1)):
        assert (getattr(v, name).view(b, q)[r:] == pad).all(), name
    for name in ("prefix_lens", "seq_lens", "num_tokens"):
        assert not getattr(v, name)[r:].any(), name
    assert not v.block_tables[r:].any()
    assert v.qsl.tolist() == [min(i, r) * q for i in range(b + 1)]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("static", [False, True])
def test_padding_rows_are_written_as_padding(dev, static):
    """A bucket's graph runs all its rows with a live flag per row (1 for the first r): the live rows get what
    the call over those r rows alone writes and returns; the padding rows of both buckets become padding (they
    may have been a live row of the step before), and their feature sources and KV moves are "none" (-1). The
    kernel equals the reference."""
    from specdec.kernels.advance import advance_rows_triton

    r, b, qv, qp, n, width, bs = 3, 8, 16, 8, 9, 24, 8
    g = torch.Generator().manual_seed(11)
    verify, program, accept, tokens, bt = _state(g, dev, b, b, qv, b, qp, n, width, bs)
    offsets = torch.randint(0, 9, (n + 1,), generator=g).to(dev) if static else None
    live = torch.tensor([1] * r + [0] * (b - r), device=dev)
    alone_v, alone_p = StepInputs(b, qv, width, dev), StepInputs(b, qp, width, dev)
    alone_v.dev.copy_(verify.dev)
    alone_p.dev.copy_(program.dev)
    alone = advance_rows_reference(alone_v.views(b, qv), b, qv, accept[:r], tokens[:r], bt[:r], alone_p.views(b, qp),
                                   b, qp, bs, n, offsets)
    for fn in (advance_rows_reference, advance_rows_triton):
        got_v, got_p = StepInputs(b, qv, width, dev), StepInputs(b, qp, width, dev)
        got_v.dev.copy_(verify.dev)
        got_p.dev.copy_(program.dev)
        fsrc, src, dst = fn(got_v.views(b, qv), b, qv, accept, tokens, bt, got_p.views(b, qp), b, qp, bs, n, offsets,
                            live)
        for got, alone_in, q in ((got_v, alone_v, qv), (got_p, alone_p, qp)):
            _assert_padding(got, b, q, r)
            for name in ("ids", "positions", "slots", "tree_mask", "parents"):
                live_rows = getattr(got.views(b, q), name).view(b, q)[:r]
                assert torch.equal(live_rows, getattr(alone_in.views(b, q), name).view(b, q)[:r]), (fn.__name__, name)
            for name in ("prefix_lens", "seq_lens", "num_tokens", "block_tables"):
                live_rows = getattr(got.views(b, q), name)[:r]
                assert torch.equal(live_rows, getattr(alone_in.views(b, q), name)[:r]), (fn.__name__, name)
        assert torch.equal(fsrc[:r], alone[0]) and (fsrc[r:] == -1).all()
        assert torch.equal(src[:r * qv], alone[1]) and torch.equal(dst[:r * qv], alone[2])
        assert (src[r * qv:] == -1).all() and (dst[r * qv:] == -1).all()
    assert (alone[1] >= 0).any()  # (the live rows did move some KV)


@pytest.mark.parametrize("dev", DEVICES)
def test_rows_gathered_from_the_step_before_and_the_rest_padded(dev):
    """Rows that go on when others ended: each reads its length from its row of the step before (``src``), and
    equals the call for those rows alone, moved there first (kernel and reference alike), and the rest of both
    buckets is left as a host fill of the live rows leaves it (padding, query start locations)."""
    from specdec.kernels.advance import advance_rows_triton

    b, qv, qp, n, width, bs = 8, 16, 8, 9, 24, 8
    g = torch.Generator().manual_seed(5)
    verify, program, accept, tokens, bt = _state(g, dev, b, b, qv, b, qp, n, width, bs)
    src = torch.tensor([1, 4, 5] + [0] * (b - 3), device=dev)
    live = torch.tensor([1, 1, 1] + [0] * (b - 3), device=dev)
    moved_v = StepInputs(b, qv, width, dev)  # the step before's rows 1, 4, 5 moved to rows 0, 1, 2 by hand
    moved_v.dev.copy_(verify.dev)
    pos = moved_v.views(b, qv).positions.view(b, qv)
    pos[:3] = pos[src[:3]].clone()
    alone_p = StepInputs(b, qp, width, dev)
    alone_p.dev.copy_(program.dev)
    alone = advance_rows_reference(moved_v.views(b, qv), b, qv, accept[src[:3]], tokens[src[:3]], bt[:3],
                                   alone_p.views(b, qp), b, qp, bs, n, None)
    for fn in (advance_rows_reference, advance_rows_triton):
        got_v, got_p = StepInputs(b, qv, width, dev), StepInputs(b, qp, width, dev)
        got_v.dev.copy_(verify.dev)
        got_p.dev.copy_(program.dev)
        fsrc, moved_from, moved_to = fn(got_v.views(b, qv), b, qv, accept[src], tokens[src], bt, got_p.views(b, qp),
                                        b, qp, bs, n, None, live, src)
        assert torch.equal(fsrc[:3], alone[0]) and torch.equal(moved_from[:3 * qv], alone[1]), fn.__name__
        assert torch.equal(moved_to[:3 * qv], alone[2])
        v, want_v = got_v.views(b, qv), moved_v.views(b, qv)
        for name, cols in (("ids", 1), ("positions", 1), ("slots", n + 1)):  # (a dynamic tree's nodes come later)
            assert torch.equal(getattr(v, name).view(b, qv)[:3, :cols], getattr(want_v, name).view(b, qv)[:3, :cols])
        assert torch.equal(got_p.views(b, qp).ids.view(b, qp)[:3], alone_p.views(b, qp).ids.view(b, qp)[:3])
        _assert_padding(got_v, b, qv, 3)
        _assert_padding(got_p, b, qp, 3)


@pytest.mark.parametrize("dev", DEVICES)
def test_advance_rows_op_is_the_kernel_or_the_reference(dev):
    """The op: the kernel with ``use_triton`` (the Triton backend), the reference without; both equal it."""
    from specdec.kernels.advance import advance_rows

    r, bv, qv, bp, qp, n, width, bs = 3, 4, 16, 4, 8, 9, 24, 8
    verify, program, accept, tokens, bt = _state(torch.Generator().manual_seed(7), dev, r, bv, qv, bp, qp, n, width,
                                                 bs)
    want_v, want_p = StepInputs(bv, qv, width, dev), StepInputs(bp, qp, width, dev)
    want_v.dev.copy_(verify.dev)
    want_p.dev.copy_(program.dev)
    want = advance_rows_reference(want_v.views(bv, qv), bv, qv, accept, tokens, bt, want_p.views(bp, qp), bp, qp, bs,
                                  n, None)
    for use_triton in (True, False):
        got_v, got_p = StepInputs(bv, qv, width, dev), StepInputs(bp, qp, width, dev)
        got_v.dev.copy_(verify.dev)
        got_p.dev.copy_(program.dev)
        got = advance_rows(got_v.views(bv, qv), bv, qv, accept, tokens, bt, got_p.views(bp, qp), bp, qp, bs, n, None,
                           use_triton=use_triton)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert torch.equal(got_v.dev, want_v.dev) and torch.equal(got_p.dev, want_p.dev)


def test_advance_rows_refuses_rows_past_the_buckets():
    from specdec.kernels.advance import advance_rows_triton

    verify, program = StepInputs(2, 8, 4, "cpu"), StepInputs(2, 8, 4, "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        advance_rows_triton(verify.views(2, 8), 2, 8, torch.zeros(3, 11, dtype=torch.int64),
                            torch.zeros(3, 7, dtype=torch.int64), torch.zeros(3, 4, dtype=torch.int64),
                            program.views(2, 8), 2, 8, 8, 7, None)
