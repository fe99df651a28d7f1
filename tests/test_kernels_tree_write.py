"""``kernels/tree_write.py``: the kept trees of a dynamic draft program written into a verify bucket in one launch
equal the torch ops of ``TreeWriter`` (``best_nodes_on_device`` + ``write_trees`` + ``tree_top``), element by
element, in the bucket's whole buffer (padding rows and non-live rows untouched) and the returned tokens,
parents and depths. Under TRITON_INTERPRET=1 on the CPU; compiled on CUDA when present."""

from __future__ import annotations

import os

import pytest
import torch
from kernel_inputs import dynamic_program_output

from specdec.step_inputs import StepInputs
from specdec.tree_writer import TreeWriter

DEVICES = (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + (["cuda"] if torch.cuda.is_available()
                                                                           else [])
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs TRITON_INTERPRET=1 or CUDA")


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("r,b,q,m,n,levels,live", [(1, 1, 32, 50, 31, 5, None), (3, 4, 16, 50, 15, 5, 2),
                                                   (4, 4, 64, 50, 63, 5, None), (2, 2, 8, 6, 7, 6, None),
                                                   (5, 8, 64, 60, 60, 10, 3), (2, 4, 4, 10, 3, 3, 1)])
def test_tree_write_equals_the_torch_ops(dev, r, b, q, m, n, levels, live):
    from specdec.kernels.tree_write import tree_write_triton

    g = torch.Generator().manual_seed(r * 1000 + m + n + levels)
    for _ in range(3):
        src = dynamic_program_output(g, r, m, levels).to(dev)
        flags = None if live is None else (torch.arange(r) < live).view(r, 1).to(dev)
        want_in, got_in = StepInputs(b, q, 3, torch.device(dev)), StepInputs(b, q, 3, torch.device(dev))
        want_in.dev.copy_(torch.randint(-5, 1000, want_in.dev.shape, generator=g))
        got_in.dev.copy_(want_in.dev)
        want = TreeWriter(levels, torch.device(dev), capture=False)._build(want_in.views(b, q), b, q, src.clone(), n,
                                                                          flags)
        got = tree_write_triton(got_in.views(b, q), b, q, src, n, levels, flags)
        assert torch.equal(got_in.dev, want_in.dev)  # every input of the bucket, written or kept
        for a, w in zip(got, want[:3], strict=True):  # (the writer adds the kept nodes' ranks: ``kept_ranks``)
            assert a.dtype == w.dtype and torch.equal(a, w)


@pytest.mark.parametrize("dev", DEVICES)
def test_tree_writer_uses_the_kernel_when_asked(dev, monkeypatch):
    """``TreeWriter(use_triton=True)`` builds through the kernel (and gives what the torch writer gives); the
    default writer does not launch it."""
    import specdec.kernels.tree_write as tw

    calls = []
    real = tw.tree_write_triton
    monkeypatch.setattr(tw, "tree_write_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(5)
    src = dynamic_program_output(g, 3, 20, 4).to(dev)
    results = []
    for use in (True, False):
        inputs = StepInputs(4, 16, 3, torch.device(dev))
        writer = TreeWriter(4, torch.device(dev), capture=False, use_triton=use)
        results.append((writer(inputs.views(4, 16), 4, 16, src, 15), inputs.dev.clone()))
    assert calls == [1]
    (a, a_in), (w, w_in) = results
    assert torch.equal(a_in, w_in) and all(torch.equal(x, y) for x, y in zip(a, w, strict=True))
