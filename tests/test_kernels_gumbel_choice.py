"""The Gumbel-max choice kernel and the noise kernels (``kernels/gumbel_noise.py``) against their torch references,
and the reference's sampling statistics."""

import os
from typing import NamedTuple

import torch

if not torch.cuda.is_available():  # CPU: run the Triton kernel in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from scipy import stats  # noqa: E402
from specdec.kernels.gumbel_choice import (  # noqa: E402
    choose_tokens,
    choose_tokens_reference,
    choose_tokens_triton,
)
from specdec.kernels.gumbel_noise import (  # noqa: E402
    ROUGH_ERR,
    children_scores,
    children_scores_reference,
    children_scores_triton,
    gumbel_at,
    gumbel_noise,
    gumbel_noise_triton,
    gumbel_rough,
    row_noise_key,
)
from specdec.kernels.gumbel_split import gumbel_splits  # noqa: E402
from specdec.kernels.triton_import import tl, triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INF, NAN = float("inf"), float("nan")
# (key0, key1, position) seeds of the exactness tests; positions include the 32-bit wrap of word 2 s (+ 1)
KEY_SETS = [0, 1]
ODD_POSITIONS = [0, 2**31 - 1, 2**31, 2**40 + 3]


def _keys(rows, seed, device=DEVICE):
    g = torch.Generator().manual_seed(1000 + seed)
    key0 = torch.randint(0, 2**32, (rows,), generator=g)
    key1 = torch.randint(0, 2**32, (rows,), generator=g)
    position = torch.randint(0, 2**20, (rows,), generator=g)
    position[:len(ODD_POSITIONS)] = torch.tensor(ODD_POSITIONS)[:rows]
    return key0.to(device), key1.to(device), position.to(device)


def _batch(v, dtype, seed):
    """(10, v) logits (a strided view of a wider tensor), temperatures mixing greedy and sampled rows, a kept mask
    (strided too) and special rows: ties, -inf, NaN, +inf, all -inf, nothing kept."""
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(20, v + 37, generator=g) * 3).to(DEVICE, dtype)
    x = wide[::2, 5:5 + v]  # (10, v), row stride 2 (v + 37)
    x[0] = -1.0
    x[0, [3, v // 2, v - 1]] = 4.0  # greedy ties: column 3 wins
    x[1, :] = -INF  # all -inf, sampled: column 0
    x[2, v - 1] = 50.0  # sampled, the maximum in the last partial block
    x[3, [1, 7, v - 2]] = NAN  # greedy with NaN: NaN never wins
    x[4, [0, 9]] = NAN  # sampled with NaN
    x[5, :v // 3] = -INF  # sampled, a third of the tokens impossible
    x[6, [4, v - 3]] = INF  # greedy with two +inf: the first
    x[7, :] = NAN  # all NaN, sampled: column 0
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0, 0.5, 2.0, 0.0, 1.0, 0.3, 1e-3], dtype=torch.float64)
    wide_kept = (torch.rand(10, 2 * v, generator=g) < 0.3).to(DEVICE)
    kept = wide_kept[:, v:]  # (10, v), row stride 2 v
    kept[8] = False  # sampled, nothing kept: column 0
    kept[0] = False  # greedy rows ignore kept
    kept[2, v - 1] = True
    return x, temperature.to(DEVICE), kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_kept", [False, True])
@pytest.mark.parametrize("keys", KEY_SETS)
def test_kernel_matches_reference(dtype, with_kept, keys):
    x, temperature, kept = _batch(300, dtype, seed=keys)
    kept = kept if with_kept else None
    key0, key1, position = _keys(10, keys)
    got = choose_tokens_triton(x, temperature, key0, key1, position, kept, block=128)
    want = choose_tokens_reference(x, temperature, key0, key1, position, kept)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert got[0].item() == 3 and got[1].item() == 0 and got[6].item() == 4 and got[7].item() == 0
    assert got[3].item() not in (1, 7, 298) and got[4].item() not in (0, 9)
    if with_kept:
        assert got[8].item() == 0
    else:
        assert got[2].item() == 299 and got[5].item() >= 100


def test_kernel_skips_blocks_without_kept_tokens():
    """Nucleus-like kept sets (each sampled row's 6 largest logits, scattered over 10 blocks of 32 columns, most
    blocks holding none): the kernel computes noise only in the blocks that hold one and chooses the reference's
    token, a kept one on every sampled row."""
    x, temperature, _ = _batch(300, torch.float32, seed=4)
    x = torch.nan_to_num(x, nan=0.0, posinf=50.0, neginf=-50.0)
    kept = torch.zeros_like(x, dtype=torch.bool).scatter_(1, x.topk(6, dim=1).indices, True)
    key0, key1, position = _keys(10, 4)
    got = choose_tokens_triton(x, temperature, key0, key1, position, kept, block=32)
    assert torch.equal(got, choose_tokens_reference(x, temperature, key0, key1, position, kept))
    sampled = temperature > 0
    assert kept[sampled].gather(1, got[sampled].view(-1, 1)).all()
    blocks = torch.nn.functional.pad(kept, (0, 20)).view(10, 10, 32).any(-1)  # (row, block): holds a kept token
    assert (blocks.sum(-1) <= 6).all() and blocks.sum() < 60


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_children_scores_kernel_matches_reference(dtype):
    """A sampled draft's children scores (logits * 1 / T + the target's noise at the children's position, for the
    draft vocabulary's target ids), 5 batch rows of 3 nodes over 700 draft tokens (several blocks), one greedy row
    (its logits in float32), per-row inputs strided as the device program's (columns of one (B, 3) table); on CUDA
    bit for bit, on the CPU to the interpreter's float64 log."""
    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(5, 3, 700, generator=g) * 4).to(dtype).to(DEVICE)
    table = torch.zeros(5, 3, dtype=torch.int64)
    table[:, 0], table[:, 1] = torch.randint(0, 2**32, (2, 5), generator=g)
    table[:, 2] = torch.tensor([1 / 0.7, 0.0, 1.0, 1 / 1.3, 1 / 0.2], dtype=torch.float64).view(torch.int64)
    table = table.to(DEVICE)
    inv_t, position = table[:, 2].view(torch.float64), torch.tensor([5, 9, 2**31, 70, 3], device=DEVICE)
    tokens = torch.randperm(5000, generator=g)[:700].to(DEVICE)  # the draft vocabulary's target ids
    got = children_scores_triton(logits, inv_t, table[:, 0], table[:, 1], position, tokens, block=256)
    want = children_scores_reference(logits, inv_t, table[:, 0], table[:, 1], position, tokens)
    assert got.dtype == torch.float32 and got.shape == (5, 3, 700)
    if DEVICE == "cuda":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], logits[1].float())  # the greedy row: its logits
    noise = gumbel_noise(table[:, 0], table[:, 1], position, tokens)  # (5, 700)
    torch.testing.assert_close(got[2], (logits[2].double() + noise[2]).float())  # T = 1: logits + noise
    spread = ((logits[0, 0].double() - logits[0, 1].double()) * inv_t[0]).float()  # a row's nodes share its noise
    torch.testing.assert_close(got[0, 0] - got[0, 1], spread, rtol=1e-4, atol=1e-4)
    assert torch.equal(children_scores(logits, inv_t, table[:, 0], table[:, 1], position, tokens), want)
    with pytest.raises(ValueError, match="one stride apart"):
        children_scores_triton(logits.transpose(0, 1), inv_t[:3], table[:3, 0], table[:3, 1], position[:3], tokens)


@pytest.mark.parametrize("b,n,v", [(1, 16, 600), (2, 5, 300), (20, 4, 300)])
def test_children_scores_node_groups(b, n, v):
    """The kernel splits a batch row's nodes into groups of programs when the batch is small (batch 1: nearly a
    program per node) and keeps them in one when it is large; every split gives the reference's scores."""
    g = torch.Generator().manual_seed(b)
    logits = (torch.randn(b, n, v, generator=g) * 3).to(DEVICE)
    inv_t = torch.tensor([1 / 0.7, 0.0] * b, dtype=torch.float64)[:b].to(DEVICE)
    key0, key1 = torch.randint(0, 2**32, (2, b), generator=g).to(DEVICE)
    position = torch.arange(b, device=DEVICE) + 40
    tokens = torch.randperm(4 * v, generator=g)[:v].to(DEVICE)
    got = children_scores_triton(logits, inv_t, key0, key1, position, tokens, block=256)
    want = children_scores_reference(logits, inv_t, key0, key1, position, tokens)
    if DEVICE == "cuda":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_kernel_one_block_fp16_and_other_strides():
    """A vocabulary smaller than the block, float16, and per-row inputs of stride 0 (expanded) and 2."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 50, generator=g) * 2).to(torch.float16).to(DEVICE)
    temperature = torch.tensor([0.7, 0.0, 1.0, 0.9, 9.0, 9.0, 1.5, 0.0], device=DEVICE)[::2]  # float32, stride 2
    key0 = torch.tensor([123456789], device=DEVICE).expand(4)  # stride 0
    key1 = torch.tensor([2**32 - 1], device=DEVICE).expand(4)
    position = torch.arange(4, device=DEVICE) + 17
    got = choose_tokens_triton(x, temperature, key0, key1, position, block=64)
    assert torch.equal(got, choose_tokens_reference(x, temperature, key0, key1, position))


def test_kernel_noise_is_the_reference_noise():
    key0, key1, position = _keys(4, 7)
    tokens = torch.arange(600, device=DEVICE)
    got = gumbel_noise_triton(key0, key1, position, tokens, block=256)
    want = gumbel_noise(key0, key1, position, tokens)
    if DEVICE == "cuda":
        assert torch.equal(got, want)
    else:  # numpy's float64 log (the interpreter's) and torch's CPU one may differ in the last bit
        torch.testing.assert_close(got, want, rtol=1e-15, atol=1e-15)


@pytest.mark.gpu
@pytest.mark.parametrize("with_kept", [False, True])
def test_kernel_matches_reference_at_real_size(with_kept):
    """512 rows of SmolLM2's 49,152 bf16 logits, a quarter greedy; the noise bit for bit."""
    rows, v = 512, 49152
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(rows, v, generator=g, device="cuda") * 3).to(torch.bfloat16)
    temperature = torch.where(torch.arange(rows, device="cuda") % 4 == 0, 0.0, 0.7).double()
    kept = torch.rand(rows, v, generator=g, device="cuda") < 0.05 if with_kept else None
    key0, key1, position = _keys(rows, 11)
    got = choose_tokens_triton(x, temperature, key0, key1, position, kept)
    assert torch.equal(got, choose_tokens_reference(x, temperature, key0, key1, position, kept))
    tokens = torch.arange(v, device="cuda")
    assert torch.equal(gumbel_noise_triton(key0, key1, position, tokens), gumbel_noise(key0, key1, position, tokens))


@pytest.mark.gpu
def test_children_scores_at_real_size():
    """64 batch rows of 10 nodes over the shipped draft's 24,576-token vocabulary, bf16 logits, a quarter of the
    rows greedy; the kernel's scores bit for bit the reference's, and a sparse kept set (a nucleus of 1 to 40
    tokens per row) chosen the same."""
    b, n, v = 64, 10, 24576
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = (torch.randn(b, n, v, generator=g, device="cuda") * 3).to(torch.bfloat16)
    key0, key1, position = _keys(b, 12)
    inv_t = torch.where(torch.arange(b, device="cuda") % 4 == 0, 0.0, 1 / 0.7).double()
    tokens = torch.randperm(49152, generator=g, device="cuda")[:v]
    got = children_scores_triton(logits, inv_t, key0, key1, position, tokens)
    assert torch.equal(got, children_scores_reference(logits, inv_t, key0, key1, position, tokens))
    x = (torch.randn(b, 49152, generator=g, device="cuda") * 3).to(torch.bfloat16)
    size = torch.randint(1, 41, (b, 1), generator=g, device="cuda")
    kept = torch.zeros_like(x, dtype=torch.bool).scatter_(1, x.float().topk(40, dim=1).indices,
                                                          torch.arange(40, device="cuda") < size)
    temperature = torch.full((b,), 0.7, device="cuda").double()
    got = choose_tokens_triton(x, temperature, key0, key1, position, kept)
    assert torch.equal(got, choose_tokens_reference(x, temperature, key0, key1, position, kept))


def test_choose_tokens_runs_the_kernel_with_use_triton_and_the_reference_without():
    x, temperature, kept = _batch(300, torch.float32, seed=9)
    key0, key1, position = _keys(10, 9)
    want = choose_tokens_reference(x, temperature, key0, key1, position, kept)
    for use_triton in (True, False):
        assert torch.equal(choose_tokens(x, temperature, key0, key1, position, kept, use_triton=use_triton), want)


def test_kernel_bad_arguments():
    x = torch.zeros(3, 40, device=DEVICE)
    t = torch.ones(3, device=DEVICE)
    key0, key1, position = _keys(3, 0)
    with pytest.raises(ValueError, match="x must have dtype"):
        choose_tokens_triton(x.long(), t, key0, key1, position)
    with pytest.raises(ValueError, match="x must have stride 1"):
        choose_tokens_triton(x.t(), t, key0, key1, position)
    with pytest.raises(ValueError, match="temperature must have shape"):
        choose_tokens_triton(x, t[:2], key0, key1, position)
    with pytest.raises(ValueError, match="key1 must have dtype"):
        choose_tokens_triton(x, t, key0, key1.int(), position)
    with pytest.raises(ValueError, match="kept must have shape"):
        choose_tokens_triton(x, t, key0, key1, position, torch.ones(3, 41, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="block must be"):
        choose_tokens_triton(x, t, key0, key1, position, block=100)
    assert choose_tokens_triton(x[:0], t[:0], key0[:0], key1[:0], position[:0]).shape == (0,)


# ---------------------------------------------------------------- pass 1 split over several programs per row


def _split_batch(v, dtype, seed):
    """``_batch``'s rows with ties across chunks of 32 columns: the greedy row 0's maximum at 3, v / 2 and v - 1;
    the sampled row 9 (T 1e-3) with +inf at 40 and v - 50 (score +inf twice: column 40)."""
    x, temperature, _ = _batch(v, dtype, seed)
    x[9, [40, v - 50]] = INF
    return x, temperature


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [3, 7])  # chunks of 128 and 64 columns (3 and 5 programs), neither dividing 300
def test_split_choice_matches_one_program_per_row(dtype, splits):
    """The choice without kept set split over programs per row (chunks a multiple of 32 columns) chooses, bit for
    bit, the one-program kernel's and the reference's tokens: greedy and sampled rows, ties across chunks (the
    lowest column), NaN (never chosen), all -inf and all NaN (column 0), the maximum in the last, short chunk."""
    x, temperature = _split_batch(300, dtype, seed=2)
    key0, key1, position = _keys(10, 2)
    want = choose_tokens_reference(x, temperature, key0, key1, position)
    one = choose_tokens_triton(x, temperature, key0, key1, position, block=32, splits=1)
    got = choose_tokens_triton(x, temperature, key0, key1, position, block=32, splits=splits, split_block=32)
    assert torch.equal(one, want) and torch.equal(got, want)
    assert got[[0, 1, 2, 6, 7, 9]].tolist() == [3, 0, 299, 4, 0, 40]
    assert got[3].item() not in (1, 7, 298) and got[4].item() not in (0, 9)


@pytest.mark.parametrize("splits", [3, 7])
def test_split_filtered_choice_matches_one_program_per_row(splits):
    """``choose_filtered_triton`` with its first pass split (the checks then reading the reduced partials) chooses
    what it chooses in one program per row, bit for bit, and what the reference chooses over the kept sets
    (kept = ``nucleus_probs(...) > 0``): top-p (0.3: checks past the first candidate), top-k, min-p, top-k and
    top-p both (left to the kept-set kernels), no filter, greedy rows (ties across chunks), a sampled row with
    +inf twice, NaN, all -inf. 300 columns, chunks a multiple of 32 (not dividing it)."""
    from specdec.kernels.gumbel_choice import choose_filtered_triton, filtered_choice_pass
    from specdec.kernels.nucleus import nucleus_probs

    from specdec.row_sampling import sampling_rows

    params = [(0.0, 0, 0.9), (1.0, 0, 0.3), (0.7, 0, 0.9), (1.0, 5), (0.8, 0, 1.0, 0.1), (1.0, 3, 0.8), (1.0,),
              (1.3, 0, 0.3)]
    sampling = sampling_rows([_Params(*p) for p in params], DEVICE)
    b, q, v = len(params), 2, 300
    g = torch.Generator().manual_seed(6)
    x = (torch.round(torch.randn(b, q, v, generator=g) * 12) / 4).to(DEVICE)  # (B, Q, V), many equal values
    x[0, 0] = -1.0
    x[0, 0, [70, 200, 299]] = 5.0  # greedy tie in three chunks: column 70
    x[6, 1, [100, 260]] = INF  # sampled, no filter: +inf twice, column 100
    x[2, 1] = -INF  # sampled, top-p, all -inf: column 0
    x[3, 1, [5, 64, 130]] = NAN  # sampled, top-k, NaN never chosen
    rows = x.reshape(b * q, v)
    temps = sampling.temperature.double().repeat_interleave(q)
    key0 = torch.arange(b * q, dtype=torch.int64, device=DEVICE) * 7919 + 5
    key1 = torch.full((b * q,), 321, dtype=torch.int64, device=DEVICE)
    position = torch.arange(b * q, dtype=torch.int64, device=DEVICE) + 50
    t = sampling.temperature.float().where(sampling.temperature > 0, 1.0)  # (B,) the filter's temperatures
    probs = torch.softmax(x.float() / t.view(-1, 1, 1), dim=-1)
    kept = (nucleus_probs(x, t.view(-1, 1, 1), probs, sampling, block=32) > 0).reshape(b * q, v)
    kept[12:14] = True  # the unfiltered batch row keeps every token (its probs, NaN beside +inf, do not say so)
    want = choose_tokens_reference(rows, temps, key0, key1, position, kept)
    first, done = filtered_choice_pass(x, temps, key0, key1, position, sampling, block=32, splits=1)
    split_first, split_done = filtered_choice_pass(x, temps, key0, key1, position, sampling, block=32,
                                                   splits=splits, split_block=32)
    assert torch.equal(split_done, done) and torch.equal(split_first[done > 0], first[done > 0])
    unfiltered = choose_tokens_triton(rows, temps, key0, key1, position, splits=1)
    assert ((first != unfiltered) & (done > 0)).any() and (done == 0).any()  # checks ran; rows left to the kernels
    one = choose_filtered_triton(x, temps, key0, key1, position, sampling, t, block=32, splits=1)
    got = choose_filtered_triton(x, temps, key0, key1, position, sampling, t, block=32, splits=splits,
                                 split_block=32)
    assert torch.equal(got, one) and torch.equal(got, want), (got != want).nonzero().flatten().tolist()
    assert got[[0, 5, 13]].tolist() == [70, 0, 100] and got[7].item() not in (5, 64, 130)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_split_choice_at_real_size(rows):
    """SmolLM2's 49,152 bf16 logits, a quarter of the rows greedy, top-p 0.9 (a few likely tokens over a normal
    tail): the split choices (``gumbel_splits``' count at this size, and 5 programs per row) are the one-program
    kernel's bit for bit, filtered and unfiltered; the unfiltered ones the reference's."""
    from specdec.kernels.gumbel_choice import choose_filtered_triton

    from specdec.row_sampling import sampling_rows

    v = 49152
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 1, v, generator=g, device="cuda") * 2  # (R, 1, V)
    likely = torch.randint(0, v, (rows, 1, 16), generator=g, device="cuda")
    x = x.scatter_add(-1, likely, torch.full(likely.shape, 10.0, device="cuda")).to(torch.bfloat16)
    temps = [0.0 if i % 4 == 0 else 0.7 for i in range(rows)]
    sampling = sampling_rows([_Params(t, 0, 0.9) for t in temps], "cuda")
    t = sampling.temperature.double()
    t_filter = sampling.temperature.float().where(sampling.temperature > 0, 1.0)
    key0, key1, position = _keys(rows, 13)
    flat = x.view(rows, v)
    want = choose_tokens_reference(flat, t, key0, key1, position)
    one = choose_filtered_triton(x, t, key0, key1, position, sampling, t_filter, splits=1)
    for splits in (None, 5):
        assert torch.equal(choose_tokens_triton(flat, t, key0, key1, position, splits=splits), want)
        got = choose_filtered_triton(x, t, key0, key1, position, sampling, t_filter, splits=splits)
        assert torch.equal(got, one), (got != one).nonzero().flatten().tolist()


class _Params(NamedTuple):
    """A request's sampling parameters, as ``sampling_rows`` reads them."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


def test_split_count_and_arguments():
    """The rows make ~4 programs per SM (the interpreter counts 8 SMs), at most one program per split block, at
    least one; splits only where the choice has no kept set, rule or skip."""
    cpu = torch.device("cpu")
    assert gumbel_splits(1, 49152, 1024, cpu) == 32 and gumbel_splits(4, 49152, 1024, cpu) == 8
    assert gumbel_splits(64, 49152, 1024, cpu) == 1 and gumbel_splits(1, 300, 128, cpu) == 3
    x = torch.zeros(3, 40, device=DEVICE)
    t = torch.ones(3, device=DEVICE)
    key0, key1, position = _keys(3, 0)
    with pytest.raises(ValueError, match="splits must be >= 1"):
        choose_tokens_triton(x, t, key0, key1, position, splits=0)
    with pytest.raises(ValueError, match="split_block must be"):
        choose_tokens_triton(x, t, key0, key1, position, split_block=100)
    with pytest.raises(ValueError, match="splits must be None or 1 with kept"):
        choose_tokens_triton(x, t, key0, key1, position, torch.ones_like(x, dtype=torch.bool), splits=2)


# ---------------------------------------------------------------- the reference's statistics

LOGITS = torch.tensor([2.0, 1.4, 1.0, 0.5, 0.0, -0.3, -1.0, -2.0])
PAIRS = 20000


def _choices(temperature, kept=None, shift=0):
    """The reference's choices for LOGITS over PAIRS (key, position) pairs: 100 keys x 200 positions (+ shift)."""
    g = torch.Generator().manual_seed(42)
    keys = torch.randint(0, 2**32, (2, 100), generator=g)
    key0, key1 = (k.repeat_interleave(PAIRS // 100) for k in keys)
    position = torch.arange(PAIRS // 100).repeat(100) + shift
    x = LOGITS.expand(PAIRS, -1)
    t = torch.full((PAIRS,), temperature, dtype=torch.float64)
    kept = None if kept is None else kept.expand(PAIRS, -1)
    return choose_tokens_reference(x, t, key0, key1, position, kept)


def _p_value(choices, probs):
    counts = torch.bincount(choices, minlength=len(probs)).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0
    return stats.chisquare(counts[keep].numpy(), (probs[keep] * PAIRS).numpy()).pvalue


def test_choices_follow_softmax_over_temperature_and_not_softmax():
    choices = _choices(0.7)
    assert _p_value(choices, torch.softmax(LOGITS.double() / 0.7, -1)) > 1e-3
    assert _p_value(choices, torch.softmax(LOGITS.double(), -1)) < 1e-6  # the negative control: T = 1


def test_choices_over_a_kept_set_follow_the_renormalised_distribution():
    kept = torch.zeros(8, dtype=torch.bool)
    kept[:3] = True
    probs = torch.softmax(LOGITS.double() / 0.7, -1) * kept
    assert _p_value(_choices(0.7, kept), probs / probs.sum()) > 1e-3


def test_choices_at_neighbouring_positions_are_independent():
    here, there = _choices(0.7).double(), _choices(0.7, shift=1).double()
    assert not torch.equal(here, there)
    assert abs(torch.corrcoef(torch.stack([here, there]))[0, 1].item()) < 0.04  # ~4 sigma of 1 / sqrt(PAIRS)
    p = torch.softmax(LOGITS.double() / 0.7, -1)
    assert abs((here == there).double().mean().item() - (p * p).sum().item()) < 0.02


# ---------------------------------------------------------------- the rough noise that spares exact scoring

@triton.jit
def _rough_and_exact_kernel(key0_ptr, key1_ptr, pos_ptr, rough_ptr, exact_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    sub0, sub1 = row_noise_key(key0_ptr, key1_ptr, pos_ptr, row, 1, 1, 1)
    tl.store(rough_ptr + row * n + cols, gumbel_rough(sub0, sub1, cols), mask=ok)
    tl.store(exact_ptr + row * n + cols, gumbel_at(sub0, sub1, cols), mask=ok)


def _rough_and_exact(key0, key1, position, n):
    """(R, n) float32 rough noise and (R, n) float64 exact noise of columns 0..n-1 (``gumbel_rough``,
    ``gumbel_at``)."""
    r = key0.shape[0]
    rough = torch.empty(r, n, dtype=torch.float32, device=key0.device)
    exact = torch.empty(r, n, dtype=torch.float64, device=key0.device)
    _rough_and_exact_kernel[(r, triton.cdiv(n, 1024))](key0, key1, position, rough, exact, n, BLOCK=1024)
    return rough, exact


def test_rough_noise_is_within_its_bound_of_the_exact_noise():
    key0, key1, position = _keys(6, 7)
    rough, exact = _rough_and_exact(key0, key1, position, 1 << 15)
    reference = gumbel_noise(key0, key1, position, torch.arange(1 << 15, device=DEVICE))
    if DEVICE == "cuda":  # the kernel's float64 logs are torch's (libdevice): the same noise to the bit
        assert torch.equal(exact, reference)
    else:  # the interpreter's logs are numpy's, whose SIMD float64 log (AVX-512 hosts) may round one ulp off torch's
        torch.testing.assert_close(exact, reference, rtol=2.0**-50, atol=2.0**-50)
    flagged = torch.isinf(rough)
    assert (rough[flagged] > 0).all()  # a flagged column is +inf: always scored exactly
    assert flagged.float().mean() < 1e-4  # (the uniform within 2**-20 of 0 or 1: ~2e-6 of the columns)
    diff = (rough.double() - exact)[~flagged].abs()
    assert diff.max() <= 2.0**-10 < ROUGH_ERR.value  # the bound the choices' exact-scoring test leans on, 16x over
    # the tails of G are where one hash word bounds it worst: the largest and smallest noise still within the bound
    top = exact[~flagged].max()
    assert top > 8 and diff[exact[~flagged] > top - 1].max() <= 2.0**-10


def test_near_ties_across_blocks_choose_the_references_token():
    """Per row a column b in the first half whose rough noise most overstates its exact noise and a column a in the
    second half whose rough noise most understates it, their logits set so that a's exact score beats b's by one
    float32 step of the logit (~2e-7, far below the rough noise's error): a walk that trusted the rough scores
    (``ROUGH_ERR`` 0) skips a's block once b's was scored, and fails here; the choice must be a, the reference's
    token, on every path (one program per row at two block sizes, split over programs, a kept set)."""
    rows, v = 16, 4096
    key0, key1, position = _keys(rows, 3)
    rough, exact = _rough_and_exact(key0, key1, position, v)
    over = (rough.double() - exact).masked_fill(torch.isinf(rough), 0.0)  # (rows, v): rough minus exact noise
    x = torch.full((rows, v), -20.0, device=DEVICE)  # the other columns score below -20 + 12
    temperature = torch.ones(rows, dtype=torch.float64, device=DEVICE)
    for r in range(rows):  # scores of 3: small logits, so that the bound's share of |x / t| stays small
        b = int(over[r, :v // 2].argmax())
        a = v // 2 + int(over[r, v // 2:].argmin())
        x[r, b] = torch.tensor(3.0 - exact[r, b].item(), dtype=torch.float32)
        score_b = x[r, b].double() + exact[r, b]
        xa = torch.tensor(score_b.item() - exact[r, a].item(), dtype=torch.float32)
        while xa.double() + exact[r, a] <= score_b:  # the smallest float32 logit that puts a ahead of b
            xa = torch.nextafter(xa, torch.tensor(float("inf")))
        x[r, a] = xa
    want = choose_tokens_reference(x, temperature, key0, key1, position)
    assert all(want[r] >= v // 2 for r in range(rows))  # every row's exact winner is its column a
    for kw in ({"block": 64}, {"block": 256, "splits": 1}, {"block": 64, "splits": 5},
               {"block": 64, "splits": 2, "split_block": 64}):  # (the last: two programs of 32 blocks, rough)
        got = choose_tokens_triton(x, temperature, key0, key1, position, **kw)
        assert torch.equal(got.cpu(), want.cpu()), kw
    kept = torch.ones(rows, v, dtype=torch.bool, device=DEVICE)
    got = choose_tokens_triton(x, temperature, key0, key1, position, kept=kept, block=64)
    assert torch.equal(got.cpu(), want.cpu())
