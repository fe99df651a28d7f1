"""The small-k top-k kernel against its reference: values and indices equal exactly, ties included."""

import math
import os

import torch

if not torch.cuda.is_available():  # CPU: run the Triton kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from specdec.kernels.topk import (  # noqa: E402
    MAX_K,
    METHODS,
    topk,
    topk_logprobs,
    topk_logprobs_reference,
    topk_logprobs_small,
    topk_reference,
    topk_small,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")


def _tied_rows(r: int, n: int, dtype, seed: int) -> torch.Tensor:  # (r, n)
    """Few distinct values (many ties; zeros of both signs), some -inf, NaNs in row 0, +inf in the last row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (r, n), generator=g).float() / 2
    x = torch.where((x == 0) & (torch.rand(r, n, generator=g) < 0.5), -0.0, x)
    x[torch.rand(r, n, generator=g) < 0.2] = -INF
    x[0, n // 3] = x[0, n - 1] = NAN
    x[-1, n // 2] = INF
    return x.to(DEVICE, dtype)


def _assert_same(got, want):
    assert torch.equal(got.indices, want.indices), (got.indices, want.indices)
    assert torch.equal(got.values.isnan(), want.values.isnan())
    assert torch.equal(got.values.nan_to_num(), want.values.nan_to_num())
    assert got.values.dtype == want.values.dtype and got.indices.dtype == torch.int64


def test_reference_follows_the_rule():
    """Descending; NaN first and NaNs tied; -0.0 ties +0.0; equal values by lower index."""
    row = [1.0, NAN, 3.0, -0.0, 0.0, -INF, 3.0, NAN, INF, 0.0]
    rank = lambda i: (0 if math.isnan(row[i]) else 1, -row[i] if not math.isnan(row[i]) else 0, i)  # noqa: E731
    want = sorted(range(len(row)), key=rank)
    for dtype in (torch.float32, torch.bfloat16):
        got = topk_reference(torch.tensor([row], dtype=dtype), len(row))
        assert got.indices[0].tolist() == want
        signed = torch.tensor([row], dtype=dtype)
        signed[0, 7] = -signed[0, 7]  # a NaN with its sign bit set ranks first as well
        assert topk_reference(signed.to(DEVICE), len(row)).indices[0].tolist() == want


@pytest.mark.parametrize("r,n,block", [(3, 37, 16), (2, 1000, 2048), (4, 3000, 2048), (2, 3000, 256)])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", METHODS)
def test_topk_small_equals_reference(r, n, block, k, dtype, method):
    """One launch (a row in one block), two launches, and blocks shorter than k (37 columns in 16s); each way of
    taking a block's best k."""
    x = _tied_rows(r, n, dtype, seed=n + k)
    got = topk_small(x, k, block=block, method=method)
    _assert_same(got, topk_reference(x, k))
    assert torch.equal(got.values.nan_to_num(), torch.topk(x, k, dim=-1).values.nan_to_num())


@pytest.mark.parametrize("fill", [-INF, NAN, 2.5, 0.0])
def test_rows_of_one_value_take_the_first_columns(fill):
    x = torch.full((2, 300), fill, device=DEVICE)
    if fill == 0.0:
        x[:, 1::2] = -0.0  # tied with +0.0
    got = topk_small(x, 4, block=64)
    _assert_same(got, topk_reference(x, 4))
    assert got.indices.tolist() == [[0, 1, 2, 3]] * 2


def test_row_stride_and_empty_batch():
    x = _tied_rows(3, 500, torch.float32, seed=1)
    wide = torch.zeros(3, 700, device=DEVICE)
    wide[:, :500] = x
    _assert_same(topk_small(wide[:, :500], 4, block=128), topk_reference(x, 4))
    out = topk_small(torch.zeros(0, 50, device=DEVICE), 3)
    assert out.values.shape == (0, 3) and out.indices.shape == (0, 3)


def test_topk_op_dispatch():
    """On the Triton backend the op flattens leading dims and follows the tie rule; past MAX_K it is torch.topk."""
    x = _tied_rows(6, 200, torch.float32, seed=3).view(2, 3, 200)
    tri, ref = topk(x, 4, use_triton=True), topk_reference(x, 4)
    assert tri.values.shape == (2, 3, 4)
    _assert_same(tri, ref)
    wide = topk(x, MAX_K + 1, use_triton=True)
    assert torch.equal(wide.values.nan_to_num(), torch.topk(x, MAX_K + 1).values.nan_to_num())
    ours = topk(x, 4, use_triton=False)
    assert torch.equal(ours.values.nan_to_num(), ref.values.nan_to_num())


def _assert_close_logprobs(got, want):
    """Same columns; log probabilities equal to float rounding, NaN where log_softmax has NaN."""
    assert torch.equal(got.indices, want.indices), (got.indices, want.indices)
    assert got.values.dtype == torch.float32 and torch.equal(got.values.isnan(), want.values.isnan())
    torch.testing.assert_close(got.values.nan_to_num(), want.values.nan_to_num(), rtol=0, atol=2e-5)


@pytest.mark.parametrize("r,n,block,k", [(3, 37, 16, 4), (4, 3000, 2048, 1), (3, 3000, 256, 4), (2, 3000, 256, 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", METHODS)
def test_topk_logprobs_equals_reference(r, n, block, k, dtype, method):
    """Tied, -inf, NaN (row 0) and +inf (last row: NaN log probabilities) rows, one and two launches."""
    x = _tied_rows(r, n, dtype, seed=2 * n + k)
    x[1] = (torch.randn(n) * 3).to(x)  # a row of distinct finite values: log probabilities of every size
    got = topk_logprobs_small(x, k, block=block, method=method)
    want = topk_logprobs_reference(x, k)
    _assert_close_logprobs(got, want)
    assert not got.values[1].isnan().any() and torch.equal(got.indices, topk_small(x, k, block=block).indices)


def test_topk_logprobs_of_a_row_of_minus_inf_is_nan():
    x = torch.full((2, 300), -INF, device=DEVICE)
    x[1, 7] = 1.0  # one finite column: log probability 0, the rest -inf
    got = topk_logprobs_small(x, 2, block=64)
    assert got.values[0].isnan().all() and got.values[1].tolist() == [0.0, -INF]
    assert got.indices[1].tolist() == [7, 0]


def test_topk_logprobs_op_dispatch():
    """Both ways: log_softmax's top-k (the torch path exactly); the Triton one flattens leading dims."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 3, 500, generator=g) * 4).to(DEVICE)
    want = torch.topk(torch.log_softmax(x, dim=-1), 4)
    ours = topk_logprobs(x, 4, use_triton=False)
    assert torch.equal(ours.indices, want.indices) and torch.equal(ours.values, want.values)
    tri = topk_logprobs(x, 4, use_triton=True)
    assert tri.values.shape == (2, 3, 4)
    _assert_close_logprobs(tri, topk_logprobs_reference(x, 4))
    wide = topk_logprobs(x, MAX_K + 1, use_triton=True)  # past MAX_K: the torch path
    assert torch.equal(wide.values, torch.topk(torch.log_softmax(x, dim=-1), MAX_K + 1).values)


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(2, 5), 6), "k must be"),
    ((torch.zeros(2, 50), 0), "k must be"),
    ((torch.zeros(2, 50), MAX_K + 1), "k must be"),
    ((torch.zeros(2, 50), 2.0), "k must be"),
    ((torch.zeros(50), 2), "x must have shape"),
    ((torch.zeros(2, 3, 50), 2), "x must have shape"),
    ((torch.zeros(2, 50, dtype=torch.int32), 2), "x must have dtype"),
    ((torch.zeros(50, 2).t(), 2), "stride 1"),
    ((torch.zeros(2, 0), 1), "columns"),
])
def test_bad_arguments_name_the_field(args, match):
    x, k = args
    with pytest.raises(ValueError, match=match):
        topk_small(x.to(DEVICE), k)


def test_method_must_be_known():
    with pytest.raises(ValueError, match="method must be one of"):
        topk_small(torch.zeros(2, 50, device=DEVICE), 2, method="radix")


def test_block_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="block"):
        topk_small(torch.zeros(2, 50, device=DEVICE), 2, block=100)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the draft vocabulary at full size needs compiled kernels")
@pytest.mark.parametrize("r", [1, 8, 64 * 8])
@pytest.mark.parametrize("k", [1, 2, 4, 8, 10, 16])
@pytest.mark.parametrize("method", METHODS)
def test_draft_vocabulary_on_gpu(r, k, method):
    """bf16 rows over a 24,576-token draft vocabulary (many ties); the reference sorts on the CPU."""
    g = torch.Generator().manual_seed(r + k)
    x = (torch.randn(r, 24576, generator=g) * 4).to(torch.bfloat16)
    got = topk_small(x.cuda(), k, method=method)
    _assert_same(type(got)(got.values.cpu(), got.indices.cpu()), topk_reference(x, k))
    got = topk_logprobs_small(x.cuda(), k, method=method)
    _assert_close_logprobs(type(got)(got.values.cpu(), got.indices.cpu()), topk_logprobs_reference(x, k))
