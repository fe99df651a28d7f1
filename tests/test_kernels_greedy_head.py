"""The fused greedy head (argmax + finite check per logits row) against its torch reference."""

import os

import torch

if not torch.cuda.is_available():  # CPU: run the Triton kernel in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from specdec.kernels.greedy_head import greedy_head, greedy_head_triton  # noqa: E402

from specdec.models.layer_ops import greedy_head_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# CPU (interpreter): a vocabulary that is not a multiple of the block; GPU: SmolLM2's 49,152 at verify sizes
SHAPES = [(6, 300, 128)] if DEVICE == "cpu" else [(1, 49152, 2048), (144, 49152, 2048), (960, 49152, 2048)]
DTYPES = [torch.float32, torch.bfloat16]


def _logits(t, v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, v, generator=g) * 4
    # ties: a row whose maximum appears three times (the first must win), across blocks and inside one
    x[0, :] = -1.0
    x[0, [7, v // 2, v - 1]] = 5.0
    if t > 1:
        x[1, :] = float("-inf")  # all -inf: not finite, argmax column 0 like torch
    if t > 2:
        x[2, v - 1] = 100.0  # the maximum in the last (partial) block
    return x.to(DEVICE, dtype)


@pytest.mark.parametrize("t,v,block", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_head_matches_reference(t, v, block, dtype):
    x = _logits(t, v, dtype, seed=t + v)
    arg, finite = greedy_head_triton(x, block=block)
    want_arg, want_finite = greedy_head_reference(x)
    assert arg.dtype == torch.int64 and finite.dtype == torch.bool
    assert torch.equal(finite, want_finite)
    assert torch.equal(arg[want_finite], want_arg[want_finite])
    assert arg[0].item() == 7  # ties: the first maximum
    if t > 1:
        assert not finite[1].item() and arg[1].item() == 0
    if t > 2:
        assert arg[2].item() == v - 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_greedy_head_flags_rows_with_nan_or_inf(bad):
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    x[1, 257] = bad  # in the partial last block of 128
    _, finite = greedy_head_triton(x, block=128)
    assert finite.tolist() == [True, False, True]


def test_greedy_head_strided_rows_and_bad_arguments():
    wide = torch.randn(4, 512, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    view = wide[:, :300]  # row stride 512, last dim contiguous
    assert torch.equal(greedy_head_triton(view, block=128)[0], view.argmax(-1))
    with pytest.raises(ValueError, match="logits must have shape"):
        greedy_head_triton(wide[0])
    with pytest.raises(ValueError, match="logits must have dtype"):
        greedy_head_triton(wide.long())
    with pytest.raises(ValueError, match="1 .. "):
        greedy_head_triton(wide[:, :0])
    arg, finite = greedy_head_triton(wide[:0])
    assert arg.shape == (0,) and finite.shape == (0,)


def test_greedy_head_op_runs_the_kernel_on_the_triton_backend_and_the_reference_otherwise():
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    for use_triton, want in ((True, greedy_head_triton), (False, greedy_head_reference)):
        got, expect = greedy_head(x, use_triton=use_triton), want(x)
        assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])
