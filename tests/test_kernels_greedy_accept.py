"""The one-launch greedy acceptance of a verify batch against ``greedy_step_outcome`` (its torch reference)."""

import os

import torch

if not torch.cuda.is_available():  # CPU: run the Triton kernel in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from specdec.kernels.greedy_accept import greedy_accept, greedy_accept_triton  # noqa: E402

from specdec.acceptance_batched import greedy_step_outcome  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(b: int, q: int, vocab: int, seed: int):
    """Random trees (node j's parent among 0..j-1), a tiny vocabulary so that drafts often match the argmax
    and siblings often share a token; row 0 is padding, row 1 is only its root, the others use 1..q tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(b, q, dtype=torch.int64)
    parents = torch.full((b, q), -1, dtype=torch.int64)
    masks = torch.zeros(b, q, dtype=torch.int64)
    num = torch.randint(1, q + 1, (b,), generator=g)
    num[0], num[min(1, b - 1)] = 0, 1
    for r in range(b):
        for j in range(int(num[r])):
            p = -1 if j == 0 else int(torch.randint(0, j, (1,), generator=g))
            parents[r, j] = p
            bit = (1 << j) - (1 << 64) if j == 63 else 1 << j  # bit 63 as a signed int64
            masks[r, j] = bit | (0 if p < 0 else int(masks[r, p]))
            tokens[r, j] = int(torch.randint(0, vocab, (1,), generator=g))
    argmax = torch.randint(0, vocab, (b, q), generator=g)
    finite = torch.rand(b, q, generator=g) > 0.05
    return [t.to(DEVICE) for t in (tokens, parents, masks, argmax, finite, num)]


@pytest.mark.parametrize("q", [1, 2, 9, 16, 64])
def test_greedy_accept_equals_the_reference(q):
    for seed in range(3):
        args = _batch(6, q, vocab=2 if q > 2 else 3, seed=seed * 100 + q)
        got, want = greedy_accept_triton(*args), greedy_step_outcome(*args)
        assert got.shape == (6, q + 3)
        assert torch.equal(got, want), (got, want)
        assert torch.equal(greedy_accept(*args, use_triton=True), got)  # the op: the kernel on the Triton backend
        assert torch.equal(greedy_accept(*args, use_triton=False), want)
    if q > 2:  # the batches exercised acceptance: some row took a node (a test that could fail)
        assert any(int(greedy_step_outcome(*_batch(6, q, 2, s * 100 + q))[:, 0].max()) > 0 for s in range(3))


def test_greedy_accept_bad_arguments():
    args = _batch(2, 4, 2, 0)
    with pytest.raises(ValueError, match="1 .. 64 columns"):
        greedy_accept_triton(torch.zeros(2, 65, dtype=torch.int64, device=DEVICE), *args[1:])
    with pytest.raises(ValueError, match="finite must have dtype"):
        greedy_accept_triton(*args[:4], args[4].long(), args[5])
    with pytest.raises(ValueError, match="num_tokens must have shape"):
        greedy_accept_triton(*args[:5], args[5][:1])
