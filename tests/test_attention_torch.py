"""The padded (batched) torch attention equals the per-row reference, causal and tree-masked."""

import pytest
import torch

from specdec.attention.torch_backend import paged_attention, paged_attention_padded


def _inputs(seed, hq, hkv):
    g = torch.Generator().manual_seed(seed)
    nbk, bs, d = 64, 4, 8
    kc, vc = torch.randn(nbk, bs, hkv, d, generator=g), torch.randn(nbk, bs, hkv, d, generator=g)
    bt = torch.randperm(nbk, generator=g)[:60].view(3, 20).int()
    q = torch.randn(12, hq, d, generator=g)
    qsl = torch.tensor([0, 4, 9, 12]).int()
    pre, sl = torch.tensor([10, 3, 0]).int(), torch.tensor([16, 8, 3]).int()
    return q, kc, vc, bt, qsl, pre, sl


@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("tree", [False, True])
def test_padded_matches_reference(hq, hkv, tree):
    q, kc, vc, bt, qsl, pre, sl = _inputs(hq * 10 + hkv, hq, hkv)
    # row 0: 4 queries at region positions 2..5 of a 6-long region; row 1: chain; row 2: a branch
    tm = torch.tensor([1 | 4, 2 | 8, 1 | 16, 1 | 4 | 32, 1, 3, 7, 15, 31, 1, 3, 5]) if tree else None
    ref = paged_attention(q, kc, vc, bt, qsl, pre, sl, tm, 0.3)
    out = paged_attention_padded(q, kc, vc, bt, qsl, pre, sl, tm, 0.3)
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_tree_mask_changes_result():
    """A different mask must change the output (the mask is really applied)."""
    q, kc, vc, bt, qsl, pre, sl = _inputs(0, 4, 2)
    full = torch.tensor([63] * 12)
    tm = torch.tensor([1 | 4, 2 | 8, 1 | 16, 1 | 4 | 32, 1, 3, 7, 15, 31, 1, 3, 5])
    a = paged_attention_padded(q, kc, vc, bt, qsl, pre, sl, full, 0.3)
    b = paged_attention_padded(q, kc, vc, bt, qsl, pre, sl, tm, 0.3)
    assert not torch.allclose(a[:4], b[:4])
