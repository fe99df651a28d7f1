"""The sort-free top-k / top-p / min-p kernel against the sort-based reference: the same kept tokens and the
same probabilities to float rounding, except in rows where the reference's cumulative mass is within float
rounding of top_p (or a probability within rounding of min_p times the top one's): those rows are detected
from the reference's own cumsum and left out. Logits are rounded to a few bits, so ties are everywhere."""

import os
from typing import NamedTuple

import torch

if not torch.cuda.is_available():  # CPU: run the Triton kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from specdec.kernels.nucleus import filtered_probs, filtered_probs_reference, nucleus_probs  # noqa: E402

from specdec.row_sampling import RowSampling, sampling_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INF = float("inf")


class Params(NamedTuple):
    """A request's sampling parameters, as ``sampling_rows`` reads them."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


def _logits(b: int, q: int, v: int, seed: int, scale: float = 3.0, steps: int = 4) -> torch.Tensor:  # (B, Q, V)
    """Normal logits times ``scale`` rounded to multiples of 1 / steps: many equal values."""
    g = torch.Generator().manual_seed(seed)
    return (torch.round(torch.randn(b, q, v, generator=g) * scale * steps) / steps).to(DEVICE)


def _inputs(x: torch.Tensor, params: list[Params]):
    """(t (B, 1, ..., 1), probs = softmax(x / t) float32, sampling) as the sampled rule builds them."""
    sampling = sampling_rows(params, DEVICE)
    t = sampling.temperature.float().view((-1,) + (1,) * (x.dim() - 1))
    return t, torch.softmax(x.float() / t, dim=-1), sampling


def _borderline(x: torch.Tensor, t: torch.Tensor, sampling: RowSampling, rel: float) -> torch.Tensor:  # (B, ...)
    """Rows where some cumulative mass of the reference (in rank order, over the top k) is within ``rel`` of
    top_p, or some probability within ``rel`` (of the top one) of min_p times the top one."""
    vocab = x.shape[-1]
    xs = torch.sort(x.float(), dim=-1, descending=True, stable=True).values
    k = torch.where(sampling.top_k > 0, sampling.top_k.clamp(max=vocab), vocab).view(t.shape)
    kept = torch.softmax((xs / t).masked_fill(torch.arange(vocab, device=x.device) >= k, -INF), dim=-1)
    top_p = sampling.top_p.float().view(t.shape)
    near = ((kept.cumsum(-1) - top_p).abs() <= rel * top_p) & (sampling.top_p < 1.0).view(t.shape)
    if sampling.min_p is not None:
        min_p = sampling.min_p.float().view(t.shape)
        tied_first = xs == xs[..., :1]  # kept by both, exactly: probability equal to the first's
        near |= ((kept - min_p * kept[..., :1]).abs() <= rel * kept[..., :1]) & (min_p > 0) & ~tied_first
    return near.any(-1)


def _check(x, t, probs, sampling, block, rel=1e-6, max_borderline=0.25):
    """The kernel on x against the reference on x in float32; returns the kernel's probabilities."""
    got = nucleus_probs(x, t, probs, sampling, block=block)
    want = filtered_probs_reference(x.float(), t, probs, sampling)
    assert got.shape == want.shape and got.dtype == torch.float32
    skip = _borderline(x, t, sampling, rel)
    assert skip.float().mean() <= max_borderline, "too few rows compared"
    g, w = got[~skip], want[~skip]
    assert torch.equal(g.isnan(), w.isnan())
    g, w = g.nan_to_num(), w.nan_to_num()
    assert torch.equal(g > 0, w > 0), (g > 0).ne(w > 0).nonzero()[:8]
    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    return got


MIXED = [Params(0.7, 0, 0.9), Params(1.0, 20), Params(0.5, 50, 0.8), Params(1.3, 0, 1.0, 0.05),
         Params(0.8, 10, 0.95, 0.1), Params(1.0)]  # the last row has no filter: probs comes back


@pytest.mark.parametrize("q,v,block,dtype", [(2, 1000, 256, torch.bfloat16), (1, 300, 64, torch.float32)])
def test_mixed_rows_match_the_reference(q, v, block, dtype):
    """B x Q rows, each batch row its own filters; bf16 logits given as they are."""
    x = _logits(len(MIXED), q, v, seed=v).to(dtype)
    t, probs, sampling = _inputs(x, MIXED)
    got = _check(x, t, probs, sampling, block)
    assert torch.equal(got[-1], probs[-1])


CASES = {
    "top_k": [Params(0.7, 1), Params(1.0, 7), Params(0.9, 100), Params(1.2, 599)],
    "top_p": [Params(0.7, 0, 0.3), Params(1.0, 0, 0.9), Params(0.6, 0, 0.99), Params(1.2, 0, 0.999)],
    "both": [Params(0.7, 5, 0.5), Params(1.0, 40, 0.9), Params(0.5, 300, 0.95), Params(1.5, 2, 0.99)],
    "min_p": [Params(0.7, 0, 1.0, 0.2), Params(1.0, 0, 0.9, 0.05), Params(1.0, 30, 1.0, 0.01),
              Params(0.8, 0, 1.0, 1.0)],
    "k_at_least_v": [Params(0.7, 600), Params(1.0, 601, 0.9), Params(1.0, 10**6, 1.0, 0.1), Params(0.9, 600, 1.0)],
    "top_p_tiny": [Params(0.7, 0, 1e-6), Params(1.0, 50, 1e-4), Params(2.0, 0, 1e-6, 0.5), Params(1.0, 3, 1e-6)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_filters_match_the_reference(case):
    """Each filter alone and together, k >= V (off), top_p so small that only the first token stays."""
    params = CASES[case]
    x = _logits(len(params), 1, 600, seed=len(case))
    t, probs, sampling = _inputs(x, params)
    got = _check(x, t, probs, sampling, block=1024)
    if case == "top_p_tiny":  # the most probable token, the first of equal ones, alone
        first = x.argmax(-1, keepdim=True)
        assert torch.equal(got, torch.zeros_like(got).scatter_(-1, first, 1.0))


def test_top_p_near_one_lists_every_top_k_token():
    """top_p so close to 1 that pruning by mass cannot leave out anything: every top-k token is a candidate.
    20 logits in [0, 2], the rest at -30: top-p keeps exactly the 20 (their last one holds > 1e-4)."""
    x = torch.full((2, 1, 600), -30.0, device=DEVICE)
    g = torch.Generator().manual_seed(8)
    for b in range(2):
        x[b, 0, torch.randperm(600, generator=g)[:20]] = torch.linspace(0, 2, 20)
    t, probs, sampling = _inputs(x, [Params(1.0, 0, 0.99995), Params(1.0, 100, 0.99995, 0.001)])
    got = _check(x, t, probs, sampling, block=128)
    assert torch.equal(got > 0, x > -30)


def test_ties_split_at_both_thresholds():
    """Logits of five values: k ends inside a group of equal logits and top_p reaches its mass in the middle of
    another, so both thresholds keep some of a tie group, by lowest id."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randint(0, 5, (2, 1, 400), generator=g).float() / 2).to(DEVICE)  # (B, 1, V) values 0 to 2
    first = [(x[b, 0] == 2.0).sum().item() for b in range(2)]  # tokens of the largest value
    probs = torch.softmax(x[1, 0], dim=-1)
    top_p = first[1] * probs.max().item() + 2.5 * probs[x[1, 0] == 1.5][0].item()  # 2.5 tokens into the next value
    t, p, sampling = _inputs(x, [Params(1.0, first[0] + 7), Params(1.0, 0, top_p)])
    got = _check(x, t, p, sampling, block=64)
    for b, second in ((0, 7), (1, 3)):  # top-p keeps the 3 tokens whose mass before them is below top_p
        kept = got[b, 0][x[b, 0] == 1.5] > 0
        assert kept[:second].all() and not kept[second:].any()  # the group split, lowest ids first
        assert (got[b, 0] > 0).sum() == first[b] + second


def test_rows_of_one_value_keep_the_first_ids():
    x = torch.full((3, 1, 300), 1.5, device=DEVICE)
    t, probs, sampling = _inputs(x, [Params(0.7, 5), Params(1.0, 0, 0.505), Params(1.0, 0, 1.0, 0.5)])
    got = _check(x, t, probs, sampling, block=64)
    assert torch.equal(got[0, 0, :5], torch.full((5,), 0.2, device=DEVICE)) and not got[0, 0, 5:].any()
    assert (got[1, 0, :152] > 0).all() and not got[1, 0, 152:].any()  # ranks up to mass 151/300 < 0.505
    assert (got[2] > 0).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the row of -inf: -inf - -inf
def test_minus_inf_logits():
    """-inf logits (some rows with fewer finite logits than k) are dropped or kept at probability 0; a row of
    -inf alone is NaN, as the softmax makes it."""
    x = _logits(4, 2, 500, seed=3)
    g = torch.Generator().manual_seed(4)
    x[torch.rand(x.shape, generator=g).to(DEVICE) < 0.9] = -INF
    x[3] = -INF
    params = [Params(0.7, 200), Params(1.0, 0, 0.95), Params(0.8, 30, 0.99, 0.01), Params(1.0, 5, 0.9)]
    t, probs, sampling = _inputs(x, params)
    got = _check(x, t, probs, sampling, block=256)
    assert got[3].isnan().all() and not got[:3].isnan().any()


def test_parameters_follow_the_batch_row():
    """Row r of a (B, Q, V) input takes batch row r // Q's parameters: the same as the rows one batch row at a
    time, and as (B * Q, 1, V) with the parameters repeated."""
    params = [Params(0.7, 0, 0.8), Params(1.0, 15), Params(1.3, 0, 1.0, 0.1)]
    x = _logits(3, 4, 400, seed=11)
    t, probs, sampling = _inputs(x, params)
    got = nucleus_probs(x, t, probs, sampling, block=1024)
    for b in range(3):
        tb, pb, sb = _inputs(x[b:b + 1], params[b:b + 1])
        assert torch.equal(got[b:b + 1], nucleus_probs(x[b:b + 1], tb, pb, sb, block=1024))
    flat = x.view(12, 1, 400)
    tf, pf, sf = _inputs(flat, [p for p in params for _ in range(4)])
    assert torch.equal(got.view(12, 1, 400), nucleus_probs(flat, tf, pf, sf, block=1024))


def test_bf16_logits_give_the_float32_result():
    params = [Params(0.7, 0, 0.9), Params(1.0, 25, 0.8, 0.02)]
    x = _logits(2, 2, 500, seed=5, steps=64).to(torch.bfloat16)
    t, probs, sampling = _inputs(x, params)
    assert torch.equal(nucleus_probs(x, t, probs, sampling, block=1024),
                       nucleus_probs(x.float(), t, probs, sampling, block=1024))


def test_without_min_p_tensor():
    """``RowSampling.min_p`` None (no row uses min-p)."""
    x = _logits(2, 1, 300, seed=9)
    t, probs, sampling = _inputs(x, [Params(0.7, 10, 0.9), Params(1.0, 0, 0.5)])
    _check(x, t, probs, sampling._replace(min_p=None), block=64)


def test_filtered_probs_dispatch():
    """use_triton: the kernel (float16/bf16/float32 logits); else, or for float64 logits, the reference itself."""
    x = _logits(2, 2, 300, seed=2)
    t, probs, sampling = _inputs(x, [Params(0.7, 0, 0.9), Params(1.0, 20)])
    want = filtered_probs_reference(x, t, probs, sampling)
    assert torch.equal(filtered_probs(x, t, probs, sampling, use_triton=False), want)
    assert torch.equal(filtered_probs(x, t, probs, sampling, use_triton=True), nucleus_probs(x, t, probs, sampling))
    x64, t64 = x.double(), t.double()
    p64 = torch.softmax(x64 / t64, dim=-1)
    assert torch.equal(filtered_probs(x64, t64, p64, sampling, use_triton=True),
                       filtered_probs_reference(x64, t64, p64, sampling))


@pytest.mark.parametrize("change,match", [
    (lambda x, t, p, s: (x[0, 0], t, p, s), "x must be"),
    (lambda x, t, p, s: (x.int(), t, p, s), "x must have dtype"),
    (lambda x, t, p, s: (x.transpose(1, 2).contiguous().transpose(1, 2), t, p, s), "stride 1"),
    (lambda x, t, p, s: (x, t[:1], p, s), "t must have"),
    (lambda x, t, p, s: (x, t, p.double(), s), "probs must have dtype"),
    (lambda x, t, p, s: (x, t, p[:, :1], s), "probs must have shape"),
    (lambda x, t, p, s: (x, t, p, s._replace(top_k=s.top_k[:1])), "sampling.top_k must have shape"),
    (lambda x, t, p, s: (x, t, p, s._replace(top_p=s.top_p.long())), "sampling.top_p must have dtype"),
])
def test_bad_arguments_name_the_field(change, match):
    x = _logits(2, 2, 50, seed=1)
    args = change(x, *_inputs(x, [Params(0.7, 0, 0.9), Params(1.0, 20)]))
    with pytest.raises(ValueError, match=match):
        nucleus_probs(*args)
    with pytest.raises(ValueError, match="block"):
        nucleus_probs(x, *_inputs(x, [Params(0.7, 0, 0.9), Params(1.0, 20)]), block=100)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the real vocabulary needs compiled kernels")
@pytest.mark.parametrize("spread,max_borderline", [(1.0, 0.75), (2.0, 0.5), (4.0, 0.5)])
def test_real_size_on_gpu(spread, max_borderline):
    """64 x 8 rows of bf16 logits (standard deviation ``spread``: 1 is flat, 20,000 tokens in the top-p set) over
    a 49,152-token vocabulary; the float32 cumsum on the GPU drifts more than the CPU's (which adds in float64),
    so rows within 1e-5 of a threshold are borderline."""
    params = [Params(0.7, 0, 0.9), Params(1.0, 50, 0.95), Params(0.7, 0, 0.9, 0.05), Params(1.0, 20)] * 16
    g = torch.Generator().manual_seed(int(spread))
    x = (torch.randn(64, 8, 49152, generator=g) * spread).to(DEVICE, torch.bfloat16)
    t, probs, sampling = _inputs(x, params)
    _check(x, t, probs, sampling, block=2048, rel=1e-5, max_borderline=max_borderline)


@pytest.mark.parametrize("dtype,v,block", [(torch.bfloat16, 400, 128), (torch.float32, 300, 64)])
def test_keep_rule_gives_the_choices_of_the_filtered_rows(dtype, v, block):
    """``nucleus_rule`` + ``choose_tokens_triton(rule=...)`` choose, at every position, the token that the
    written filtered rows do (kept = ``nucleus_probs(...) > 0``), for filtered, unfiltered (rule: every token kept)
    and greedy rows; a rule that keeps every token of a filtered row (a negative control) chooses differently."""
    from specdec.kernels.gumbel_choice import choose_tokens_triton
    from specdec.kernels.nucleus import KeepRule, nucleus_rule

    params = MIXED + [Params(0.9, 3), Params(1.0, 0, 0.5)]
    b, q = len(params), 2
    x = _logits(b, q, v, seed=11).to(dtype)
    t, probs, sampling = _inputs(x, params)
    kept = nucleus_probs(x, t, probs, sampling, block=block) > 0  # (B, Q, V)
    rule = nucleus_rule(x, t, sampling, block=block)
    assert rule.ints[:, 0].view(b, q).tolist() == [[int(p.top_k > 0 or p.top_p < 1 or p.min_p > 0)] * q
                                                  for p in params]
    rows = x.reshape(b * q, v)
    temps = sampling.temperature.double().repeat_interleave(q)
    temps[:q] = 0.0  # the first batch row greedy (its rule is ignored)
    key0 = torch.arange(b * q, dtype=torch.int64, device=DEVICE) * 7919 + 5
    key1 = torch.full((b * q,), 12345, dtype=torch.int64, device=DEVICE)
    differs = 0
    for pos in range(40 if DEVICE == "cuda" else 4):  # (interpreted on the CPU: a few positions)
        position = torch.full((b * q,), pos, dtype=torch.int64, device=DEVICE)
        want = choose_tokens_triton(rows, temps, key0, key1, position, kept.reshape(b * q, v), block=block)
        got = choose_tokens_triton(rows, temps, key0, key1, position, block=block, rule=rule)
        assert torch.equal(got, want), (pos, (got != want).nonzero().flatten().tolist())
        loose = KeepRule(rule.ints.clone(), rule.floats)
        loose.ints[:, 0] = 0
        differs += int((choose_tokens_triton(rows, temps, key0, key1, position, block=block, rule=loose)
                        != want).sum())
    assert differs > 0


@pytest.mark.parametrize("dtype,v,block", [(torch.bfloat16, 400, 128), (torch.float32, 300, 64)])
def test_filtered_choice_is_the_choice_over_the_kept_set(dtype, v, block):
    """``choose_filtered_triton`` chooses at every position the token that the written filtered rows give (kept =
    ``nucleus_probs(...) > 0``), for top-p, top-k, min-p and their mixes, greedy rows and an unfiltered row. Its
    first kernel alone chooses every row but those with top-k and top-p both, some (top-p 0.2) only after checking
    more than one candidate; with ``max_rounds=1`` those rows go to the kept-set kernels instead, with the same
    tokens. Negative control: the choice without the filter differs."""
    from specdec.kernels.gumbel_choice import choose_filtered_triton, choose_tokens_triton, filtered_choice_pass

    params = MIXED + [Params(0.9, 3), Params(1.0, 0, 0.2), Params(0.0, 0, 0.9), Params(0.7, 0, 0.5, 0.2)]
    b, q = len(params), 2
    x = _logits(b, q, v, seed=5).to(dtype)
    t, probs, sampling = _inputs(x, params)
    kept = (nucleus_probs(x, t, probs, sampling, block=block) > 0).reshape(b * q, v)
    skip = _borderline(x.float(), t, sampling, 1e-6).reshape(b * q)
    assert skip.float().mean() < 0.2
    rows = x.reshape(b * q, v)
    temps = sampling.temperature.double().repeat_interleave(q)
    key0 = torch.arange(b * q, dtype=torch.int64, device=DEVICE) * 7919 + 5
    key1 = torch.full((b * q,), 777, dtype=torch.int64, device=DEVICE)
    both = torch.tensor([p.top_k > 0 and p.top_p < 1 and p.temperature > 0 for p in params]).repeat_interleave(q)
    refined = fell_back = differs = 0
    for pos in range(3 if DEVICE == "cuda" else 2):  # (interpreted on the CPU: two positions)
        position = torch.full((b * q,), pos, dtype=torch.int64, device=DEVICE)
        want = choose_tokens_triton(rows, temps, key0, key1, position, kept, block=block)
        unfiltered = choose_tokens_triton(rows, temps, key0, key1, position, block=block)
        differs += int((unfiltered != want)[~skip].sum())
        first, done = filtered_choice_pass(x, temps, key0, key1, position, sampling, block=block)
        assert done.cpu().bool().tolist() == (~both).tolist(), pos
        refined += int(((first != unfiltered) & (done > 0)).sum())
        for rounds in (8, 1):
            got = choose_filtered_triton(x, temps, key0, key1, position, sampling, t.view(-1), block=block,
                                         max_rounds=rounds)
            assert torch.equal(got[~skip], want[~skip]), (pos, rounds, (got != want).nonzero().flatten().tolist())
        fell_back += int((filtered_choice_pass(x, temps, key0, key1, position, sampling, block=block,
                                               max_rounds=1)[1] == 0).sum() - both.sum())
    assert refined > 0 and fell_back > 0 and differs > 0


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the real vocabulary needs compiled kernels")
def test_filtered_choice_at_real_size_on_gpu():
    """64 x 8 rows of bf16 logits over a 49,152-token vocabulary (a few likely tokens over a normal tail), top-p,
    top-k and both: ``choose_filtered_triton`` chooses what the written filtered rows give at every row not
    borderline (1e-5), at 8 positions."""
    from specdec.kernels.gumbel_choice import choose_filtered_triton, choose_tokens_triton

    params = [Params(0.7, 0, 0.9), Params(1.0, 50, 0.95), Params(0.7, 0, 0.9, 0.05), Params(1.0, 20)] * 16
    b, q, v = 64, 8, 49152
    g = torch.Generator().manual_seed(3)
    x = torch.randn(b, q, v, generator=g) * 2
    likely = torch.randint(0, v, (b, q, 16), generator=g)
    x = x.scatter_add(-1, likely, torch.full(likely.shape, 8.0)).to(DEVICE, torch.bfloat16)
    t, probs, sampling = _inputs(x, params)
    kept = (nucleus_probs(x, t, probs, sampling) > 0).reshape(b * q, v)
    skip = _borderline(x.float(), t, sampling, 1e-5).reshape(b * q)
    assert skip.float().mean() < 0.25
    rows, temps = x.reshape(b * q, v), sampling.temperature.double().repeat_interleave(q)
    key0 = torch.arange(b * q, dtype=torch.int64, device=DEVICE) * 104729 + 3
    key1 = torch.full((b * q,), 99, dtype=torch.int64, device=DEVICE)
    for pos in range(8):
        position = torch.full((b * q,), 1000 + pos, dtype=torch.int64, device=DEVICE)
        want = choose_tokens_triton(rows, temps, key0, key1, position, kept)
        got = choose_filtered_triton(x, temps, key0, key1, position, sampling, t.view(-1))
        assert torch.equal(got[~skip], want[~skip]), (pos, (got != want).nonzero().flatten().tolist()[:8])
