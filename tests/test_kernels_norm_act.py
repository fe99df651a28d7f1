"""Fused residual-add + RMSNorm, SiLU-mul and EAGLE-input kernels against their torch references."""

import os

import torch

if not torch.cuda.is_available():  # CPU: run the Triton kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from specdec.kernels.norm_act import (  # noqa: E402
    add_rmsnorm,
    add_rmsnorm_triton,
    embed_feature_norm,
    embed_feature_norm_triton,
    silu_mul,
    silu_mul_triton,
)

from specdec.models.layer_ops import (  # noqa: E402
    add_rmsnorm_reference,
    embed_feature_norm_reference,
    silu_mul_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# CPU (interpreter): small shapes; GPU: SmolLM2-135M's hidden 576 / intermediate 1536 and a 4096-wide model
SHAPES = [(5, 48, 80), (1, 64, 128)] if DEVICE == "cpu" else [(1, 576, 1536), (64, 576, 1536), (300, 4096, 14336)]
DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float32, torch.bfloat16]


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("t,hidden,inter", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_matches_reference(t, hidden, inter, dtype, with_residual):
    g = torch.Generator().manual_seed(t + hidden)
    x = (torch.randn(t, hidden, generator=g) * 3).to(DEVICE, dtype)
    res = torch.randn(t, hidden, generator=g).to(DEVICE, dtype) if with_residual else None
    w = torch.rand(hidden, generator=g).to(DEVICE, dtype) + 0.5
    got, got_h = add_rmsnorm_triton(x, res, w, 1e-5)
    want, want_h = add_rmsnorm_reference(x, res, w, 1e-5)
    torch.testing.assert_close(got_h, want_h, **_tol(dtype))
    torch.testing.assert_close(got, want, **_tol(dtype))
    assert got.abs().sum() > 0


@pytest.mark.parametrize("t,hidden,inter", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(t, hidden, inter, dtype):
    g = torch.Generator().manual_seed(t + inter)
    gu = (torch.randn(t, 2 * inter, generator=g) * 4).to(DEVICE, dtype)
    got = silu_mul_triton(gu)
    torch.testing.assert_close(got, silu_mul_reference(gu), **_tol(dtype))
    assert got.shape == (t, inter)


@pytest.mark.parametrize("t,hidden,inter", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_embed_feature_norm_matches_reference_and_the_two_norms(t, hidden, inter, dtype, ids_dtype):
    """Equal to embedding + two ``add_rmsnorm`` launches + cat exactly; float32 features cast to the table's."""
    g = torch.Generator().manual_seed(t * hidden)
    table = (torch.randn(50, hidden, generator=g) * 2).to(DEVICE, dtype)
    ids = torch.randint(0, 50, (t,), generator=g).to(DEVICE, ids_dtype)
    feats = (torch.randn(t, hidden, generator=g) * 3).to(DEVICE)  # float32
    w_e, w_f = (torch.rand(hidden, generator=g).to(DEVICE, dtype) + 0.5 for _ in range(2))
    got = embed_feature_norm_triton(ids, table, feats, w_e, w_f, 1e-5, 1e-6)
    two = torch.cat([add_rmsnorm_triton(table[ids.long()], None, w_e, 1e-5)[0],
                     add_rmsnorm_triton(feats.to(dtype), None, w_f, 1e-6)[0]], -1)
    assert got.shape == (t, 2 * hidden) and got.dtype == dtype and torch.equal(got, two)
    torch.testing.assert_close(got, embed_feature_norm_reference(ids, table, feats, w_e, w_f, 1e-5, 1e-6),
                               **_tol(dtype))


def test_bad_arguments_name_the_field():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        add_rmsnorm_triton(x, None, torch.zeros(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rmsnorm_triton(x, torch.zeros(3, 8, device=DEVICE), torch.zeros(8, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="even"):
        silu_mul_triton(torch.zeros(2, 7, device=DEVICE))
    table = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="g must have shape"):
        embed_feature_norm_triton(torch.zeros(2, dtype=torch.int64, device=DEVICE), table,
                                  torch.zeros(3, 8, device=DEVICE), table[0], table[0], 1e-5, 1e-5)


def test_ops_run_the_kernel_on_the_triton_backend_and_the_reference_otherwise():
    """``add_rmsnorm``, ``embed_feature_norm`` and ``silu_mul`` are the kernels bit for bit with ``use_triton``, the
    references bit for bit without."""
    gen = torch.Generator().manual_seed(2)
    x, res, w = (torch.randn(*shape, generator=gen).to(DEVICE) for shape in ((5, 48), (5, 48), (48,)))
    ids = torch.tensor([3, 0, 7, 1, 2], device=DEVICE)
    args = {add_rmsnorm: (x, res, w, 1e-5), silu_mul: (torch.cat([x, res], -1),),
            embed_feature_norm: (ids, torch.cat([x, res]), x, w, w, 1e-5, 1e-6)}
    kernels = {add_rmsnorm: add_rmsnorm_triton, silu_mul: silu_mul_triton,
               embed_feature_norm: embed_feature_norm_triton}
    refs = {add_rmsnorm: add_rmsnorm_reference, silu_mul: silu_mul_reference,
            embed_feature_norm: embed_feature_norm_reference}
    for op, a in args.items():
        for use_triton, want in ((True, kernels[op]), (False, refs[op])):
            got, expect = op(*a, use_triton=use_triton), want(*a)
            for g, e in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, expect)), strict=True):
                assert torch.equal(g, e), (op.__name__, use_triton)
