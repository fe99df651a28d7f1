"""The logits processors and penalties in one launch (``kernels.logit_processors``) against their torch reference:
the same bits for every combination of parts, and ``ContextPenalty.apply`` the same either way on real trees."""

import os

import torch

if not torch.cuda.is_available():  # CPU: run the Triton kernel in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from specdec.kernels.logit_processors import processed_logits_reference, processed_logits_triton  # noqa: E402

from specdec.repetition_penalty import BadWords, ContextPenalty, HeldBack, OutputCounts  # noqa: E402
from specdec.tree import DraftTree  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# CPU (interpreter): a vocabulary that is not a multiple of the block; GPU: the real vocabulary, EAGLE's buckets
SHAPES = [(3, 4, 300, 128)] if DEVICE == "cpu" else [(16, 32, 49152, 1024), (64, 8, 49152, 1024)]
PARTS = ["bias", "held", "banned", "present", "counts"]


def _case(b, q, v, seed):
    """Logits, path tokens (-1 padded, repeats), and every part, random; some logits -inf (an allowed set)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, q, v, generator=g) * 4
    path = torch.randint(0, v, (b, q, q), generator=g)
    path[torch.rand(b, q, q, generator=g) < 0.5] = -1
    path[:, :, 0] = path[:, :, 1]  # (a token twice on one path: counted twice)
    bias = torch.randn(b, v, generator=g)
    bias[0, : v // 2] = float("-inf")
    parts = dict(
        bias=bias,
        held=torch.rand(b, v, generator=g) < 0.05, early=torch.rand(b, q, generator=g) < 0.5,
        banned=torch.where(torch.rand(b, q, 3, generator=g) < 0.6, torch.randint(0, v, (b, q, 3), generator=g), -1),
        present=torch.rand(b, v, generator=g) < 0.2, penalty=1 + torch.rand(b, generator=g),
        counts=torch.randint(0, 4, (b, v), generator=g).float(),
        presence=torch.rand(b, generator=g), frequency=torch.rand(b, generator=g))
    return logits, path, parts


def _pick(parts, names):
    keys = {"held": ("held", "early"), "present": ("present", "penalty"),
            "counts": ("counts", "presence", "frequency")}
    return {k: parts[k].to(DEVICE) for n in names for k in keys.get(n, (n,))}


@pytest.mark.parametrize("b,q,v,block", SHAPES, ids=[f"{DEVICE}-{b}x{q}x{v}" for b, q, v, _ in SHAPES])
@pytest.mark.parametrize("names", [PARTS, ["bias"], ["present"], ["counts"], ["held", "banned"],
                                   ["present", "counts"]], ids="+".join)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_processed_logits_match_reference_bit_for_bit(b, q, v, block, names, dtype):
    """Every part alone and together: the kernel's float32 output equals the reference's exactly (the -inf of the
    bias, the held-back and the banned tokens included), and each part changed something."""
    logits, path, parts = _case(b, q, v, seed=b * q + len(names))
    logits, path, kw = logits.to(DEVICE, dtype), path.to(DEVICE), _pick(parts, names)
    got = processed_logits_triton(logits, path, block=block, **kw)
    want = processed_logits_reference(logits, path, **kw)
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got, want)
    assert not torch.equal(want, logits.float())


@pytest.mark.parametrize("device", [DEVICE])
def test_a_part_given_half_is_refused(device):
    logits, path, parts = _case(1, 2, 16, seed=0)
    with pytest.raises(ValueError, match="held and early"):
        processed_logits_triton(logits.to(device), path.to(device), held=parts["held"].to(device))


@pytest.mark.parametrize("device", [DEVICE])  # (its id names the device: the GPU round selects "cuda")
def test_context_penalty_applies_the_same_either_way_on_a_tree(device):
    """``ContextPenalty.apply`` on a branched tree with every part (a bad word whose lead is on one branch, a
    repeated token on a path): the one launch equals the torch reference, and the parts landed where the tree puts
    them (the bad word's last token banned only on the branch that ends with its lead)."""
    v = 40
    tree = DraftTree.of_parents([7, 8, 9, 7], [-1, 0, -1, 2])  # root -> 7 -> 8, root -> 9 -> 7
    masks, _ = tree.verify_rows()
    tokens, masks = torch.tensor([[0, 7, 8, 9, 7]], device=device), torch.tensor([masks], device=device)
    present = torch.zeros(1, v, dtype=torch.bool, device=device)
    present[0, [1, 2]] = True
    words = torch.tensor([[[-2, 9, 7, 30]]], device=device)  # the word [9, 7, 30]: 30 banned after "... 9 7"
    penalty = ContextPenalty(
        present, torch.full((1,), 1.5, device=device),
        OutputCounts(torch.ones(1, v, device=device), torch.full((1,), 0.5, device=device),
                     torch.full((1,), 0.25, device=device)),
        torch.linspace(-1, 1, v, device=device).view(1, v),
        HeldBack(torch.arange(v, device=device).view(1, v) == 2, torch.tensor([2], device=device)),
        BadWords(torch.full((1, 3), -1, device=device), words))
    logits = torch.randn(1, 5, v, generator=torch.Generator().manual_seed(3)).to(device)
    got = penalty.apply(logits, tokens, masks, use_triton=True)
    want = penalty.apply(logits, tokens, masks)
    assert torch.equal(got, want)
    banned = torch.isinf(want[0, :, 30])
    assert banned.tolist() == [False, False, False, False, True]  # (only after root -> 9 -> 7)
    assert torch.isinf(want[0, :, 2]).tolist() == [True, True, False, True, False]  # (held at depths 0 and 1)


def test_the_kernel_signature_is_the_same_whatever_parts_a_batch_has():
    """Triton compiles a kernel per signature (each pointer's dtype among it): the part arguments of every
    combination of parts have the same dtypes, so one compile serves every batch."""
    from specdec.kernels.logit_processors import kernel_parts

    logits, path, parts = _case(2, 3, 40, seed=1)
    names = ["bias", "held", "banned", "present", "counts"]
    seen = set()
    for mask in range(1 << len(names)):
        kw = _pick(parts, [n for i, n in enumerate(names) if mask >> i & 1])
        args = kernel_parts(DEVICE, *(kw.get(k) for k in ("bias", "held", "early", "banned", "present", "penalty",
                                                          "counts", "presence", "frequency")), path.to(DEVICE))
        seen.add(tuple(a.dtype if isinstance(a, torch.Tensor) else type(a) for a in args))
    assert len(seen) == 1, seen
