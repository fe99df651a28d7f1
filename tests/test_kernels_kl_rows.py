"""The fused draft-loss rows (``kernels.kl_rows``) against their torch reference, and ``training.linear_kl`` on them."""

import os

import torch

if not torch.cuda.is_available():  # CPU: run the Triton kernel in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from specdec.kernels.kl_rows import kl_rows_reference, kl_rows_triton  # noqa: E402

from specdec.training.linear_kl import RowLoss, Teacher  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# CPU (interpreter): a vocabulary that is not a multiple of the block; GPU: the shipped draft's 24,576 at a chunk
SHAPES = [(5, 300, 128)] if DEVICE == "cpu" else [(7, 24576, 2048), (8192, 24576, 2048)]


def _case(c, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(c, n, generator=g) * 3
    z[0, [5, n // 2, n - 1]] = z[0].max() + 1  # a tie of the maximum across blocks: the first wins
    if c > 1:
        z[1, n - 1] = 50.0  # the maximum in the last (partial) block
    t_logp = torch.log_softmax(torch.randn(c, n, generator=g) * 4, -1)
    t_logp[-1, : n // 3] = float("-inf")  # a teacher with no mass on some tokens
    w = torch.rand(c, generator=g)
    return z.to(DEVICE, dtype), t_logp.to(DEVICE), w.to(DEVICE)


@pytest.mark.parametrize("c,n,block", SHAPES, ids=[f"{DEVICE}-{c}x{n}" for c, n, _ in SHAPES])  # (the GPU round
# selects tests by "cuda" in their names)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,sampled_weight,grad,measure", [
    (None, 0.0, True, False), (0.7, 0.5, True, False), (0.5, 0.0, False, True), (0.7, 1.0, True, True)])
def test_kl_rows_match_reference(c, n, block, dtype, temperature, sampled_weight, grad, measure):
    """Losses, top tokens, overlap and gradient equal the reference's (float32 scoring of the same logits; the
    gradient in the logits' dtype), with and without the temperature's terms."""
    z, t_logp, w = _case(c, n, dtype, seed=c + n)
    teacher = Teacher.of(t_logp, temperature, chunk=3)
    *got, dz = kl_rows_triton(z, teacher.logp, teacher.negent, teacher.lse_t, teacher.negent_t, w,
                              temperature or 1.0, sampled_weight, grad, measure, block=block)
    got = RowLoss(*got)
    *want, want_dz = kl_rows_reference(z, teacher.logp, teacher.negent, teacher.lse_t, teacher.negent_t, w,
                                       temperature or 1.0, sampled_weight, grad, measure)
    want = RowLoss(*want)
    torch.testing.assert_close(got.kl, want.kl, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.top, want.top) and got.top[0] == 5 and (c < 2 or got.top[1] == n - 1)
    for name in ("kl_t", "overlap_t"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert (dz is None) == (not grad)
    if grad:
        assert dz.dtype == dtype and dz.abs().sum() > 0
        tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-5)
        torch.testing.assert_close(dz, want_dz, **tol)


def test_kl_rows_refuse_bad_arguments():
    z, t_logp, w = _case(3, 40, torch.float32, seed=1)
    teacher = Teacher.of(t_logp, None)
    with pytest.raises(ValueError, match="measure"):
        kl_rows_triton(z, t_logp, teacher.negent, None, None, w, 1.0, 0.0, True, True)
    with pytest.raises(ValueError, match="t_logp"):
        kl_rows_triton(z, t_logp[:, :-1], teacher.negent, None, None, w, 1.0, 0.0, True, False)


@pytest.mark.parametrize("autocast", [False] + [True] * (DEVICE == "cuda"), ids=lambda a: f"{DEVICE}-autocast{int(a)}")
def test_linear_kl_gradient_equals_autograd_through_whole_logits(autocast):
    """``linear_kl`` (the kernel on CUDA, the reference on the CPU) in chunks of 3 rows: the loss and the gradient
    with respect to the states equal autograd through ``log_softmax`` of the whole logits (float32; with bf16
    autocast on CUDA, to bf16 rounding)."""
    from specdec.training.linear_kl import linear_kl

    g = torch.Generator().manual_seed(3)
    n, h, v, temp, sw = 10, 16, 300, 0.7, 0.5
    head = torch.nn.Linear(h, v, bias=False).to(DEVICE).requires_grad_(False)
    x = torch.randn(n, h, generator=g).to(DEVICE).requires_grad_(True)
    t_logp = torch.log_softmax(torch.randn(n, v, generator=g) * 3, -1).to(DEVICE)
    w = torch.rand(n, generator=g).to(DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        loss, rows = linear_kl(x, head, Teacher.of(t_logp, temp), w, temp, sw, measure=True, chunk=3)
    (gx,) = torch.autograd.grad(loss, x)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        logits = head(x).float()
    tt = torch.log_softmax(t_logp / temp, -1)
    kl = (t_logp.exp() * (t_logp - torch.log_softmax(logits, -1))).sum(-1)
    kl_t = (tt.exp() * (tt - torch.log_softmax(logits / temp, -1))).sum(-1)
    want = (((1 - sw) * kl + sw * kl_t) * w).sum()
    (want_gx,) = torch.autograd.grad(want, x)
    tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, want, **tol)
    torch.testing.assert_close(gx, want_gx, **tol)
    torch.testing.assert_close(rows.kl, kl.detach(), **tol)
    assert torch.equal(rows.top, logits.argmax(-1))
