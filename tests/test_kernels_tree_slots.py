"""The one-launch tree-node slots and positions against the torch reference, padded rows included."""

import os

import torch

if not torch.cuda.is_available():  # CPU: run the Triton kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from specdec.kernels.tree_slots import tree_slots, tree_slots_triton  # noqa: E402

from specdec.tree_ops import tree_slots_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(b: int, n: int, levels: int, bs: int, width: int, seed: int):
    """Rows of random lengths (row 1 padded: no tokens), random block tables, ``levels`` levels of n nodes."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, bs * width - n * levels, (b,), generator=g)
    num_tokens = torch.randint(1, 4, (b,), generator=g)
    if b > 1:
        num_tokens[1] = 0
    tables = torch.randperm(b * width * 3, generator=g)[:b * width].view(b, width)
    per = [(torch.arange(lv * n, lv * n + n), lv) for lv in range(levels)]
    rows = torch.cat([torch.arange(b).repeat_interleave(n) for _ in per])
    nodes = torch.cat([idx.repeat(b) for idx, _ in per])
    depths = torch.cat([torch.full((b * n,), d) for _, d in per])
    return [t.to(DEVICE) for t in (seq_lens, num_tokens, tables, rows, nodes, depths)] + [bs]


@pytest.mark.parametrize("b,n,levels,bs,width", [(1, 10, 4, 16, 8), (3, 2, 2, 4, 12), (8, 10, 4, 256, 2)])
def test_tree_slots_equals_reference(b, n, levels, bs, width):
    args = _case(b, n, levels, bs, width, seed=b * n)
    slots, pos = tree_slots_triton(*args)
    want_slots, want_pos = tree_slots_reference(*args)
    assert torch.equal(slots, want_slots) and torch.equal(pos, want_pos)
    if b > 1:  # the padded row stores nothing
        assert (slots[args[3] == 1] == -1).all() and (slots[args[3] != 1] >= 0).all()
    both = [tree_slots(*args, use_triton=use_triton) for use_triton in (True, False)]  # the op, both ways
    assert all(torch.equal(x, y) for x, y in zip(*both))


def test_bad_arguments_name_the_field():
    args = _case(2, 3, 1, 4, 4, seed=0)
    with pytest.raises(ValueError, match="block_size"):
        tree_slots_triton(*args[:-1], 0)
    with pytest.raises(ValueError, match="nodes must have shape"):
        tree_slots_triton(*args[:4], args[4][:-1], *args[5:])
    with pytest.raises(ValueError, match="block_tables must be contiguous"):
        tree_slots_triton(*args[:2], args[2].t().contiguous().t(), *args[3:])
