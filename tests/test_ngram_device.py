"""n-gram drafting on the device (``specdec/drafters/ngram_device.py``): the one-launch kernel
(``kernels/ngram_follow.py``) equals its torch reference, the reference is ``ngram_lookup`` over the extended
history, and an engine that looks chains up on the device proposes exactly what the host lookup (without the
shared table) finds in the same text, with target-only's outputs. Kernels run under TRITON_INTERPRET=1 on the CPU
and compiled on CUDA (real history lengths there)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.drafters.ngram import NgramDrafter, NgramIndex, ngram_lookup, ngram_lookup_array
from specdec.drafters.ngram_ops import ngram_follow_reference
from specdec.errors import FieldError

KERNEL_DEVICES = (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + (
    ["cuda"] if torch.cuda.is_available() else [])


def _case(rng: random.Random, dev: str, rows: int, q: int, vocab: int, longest: int, width: int):
    """A history buffer of junk, R rows (distinct buffer rows) whose pending token sits at a random L - 1, their
    verify ids and positions, and an outcome whose path is m increasing query indices (a tree path; a chain's is
    1 .. m)."""
    hist = torch.tensor([[rng.randrange(vocab) for _ in range(width)] for _ in range(rows + 3)], dtype=torch.int32)
    buf_rows = torch.tensor(rng.sample(range(rows + 3), rows), dtype=torch.int64)
    L = [rng.randrange(1, longest) for _ in range(rows)]
    ids = torch.tensor([[rng.randrange(vocab) for _ in range(q)] for _ in range(rows)], dtype=torch.int64)
    positions = torch.tensor([[n - 1 + j for j in range(q)] for n in L], dtype=torch.int64)
    accept = torch.zeros(rows, q + 3, dtype=torch.int64)
    for i in range(rows):
        m = rng.randrange(q)  # at most q - 1 nodes below the root
        path = sorted(rng.sample(range(1, q), m)) if m else []
        rest = [j for j in range(q) if j not in path]
        accept[i] = torch.tensor([m, rng.randrange(vocab), *path, *rest, 1])
    return [t.to(dev) for t in (hist, buf_rows, ids, positions, accept)]


@pytest.mark.skipif(not KERNEL_DEVICES, reason="needs TRITON_INTERPRET=1 or CUDA")
@pytest.mark.parametrize("dev", KERNEL_DEVICES)
@pytest.mark.parametrize("q,k,max_n,min_n,vocab", [(9, 8, 4, 1, 4), (5, 4, 4, 1, 3), (1, 8, 4, 1, 2), (9, 8, 4, 2, 3),
                                                   (3, 1, 2, 1, 5), (9, 8, 3, 3, 2), (5, 6, 1, 1, 6)])
def test_kernel_equals_reference(dev, q, k, max_n, min_n, vocab):
    """Same history writes and the same (outcome, count, chain) rows; small vocabularies make matches of every
    length, continuations cut by the history's end, and rows without any match; padding rows (-1) are skipped."""
    from specdec.kernels.ngram_follow import ngram_follow, ngram_follow_triton

    rng = random.Random(q * 100 + k * 10 + max_n + vocab)
    longest, width = (3000, 3100) if dev == "cuda" else (150, 170)  # several of the kernel's 1024-token tiles
    for _ in range(4 if dev == "cuda" else 2):
        hist, rows, ids, positions, accept = _case(rng, dev, rng.randrange(1, 6), q, vocab, longest, width)
        if len(rows) > 2:
            rows[-1] = -1  # a bucket's padding row: nothing written, a zero output row
        ref_hist = hist.clone()
        ref = ngram_follow_reference(ref_hist, rows, ids, positions, accept, k, max_n, min_n)
        out = ngram_follow_triton(hist, rows, ids, positions, accept, k, max_n, min_n)
        assert torch.equal(hist, ref_hist)
        assert torch.equal(out, ref)
    for use_triton, long_n in ((True, 4), (True, 5), (False, 4)):  # the op: past max_n 4 the reference
        hist, rows, ids, positions, accept = _case(rng, dev, 3, q, vocab, longest, width)
        ref_hist = hist.clone()
        ref = ngram_follow_reference(ref_hist, rows, ids, positions, accept, k, long_n, min_n)
        out = ngram_follow(hist, rows, ids, positions, accept, k, long_n, min_n, use_triton=use_triton)
        assert torch.equal(hist, ref_hist) and torch.equal(out, ref)


def test_array_lookup_equals_the_scan():
    """``ngram_lookup_array`` (the budget controller's free chains) gives ``ngram_lookup``'s chain on random texts
    of small vocabularies (many matches) and large ones (few), for every n range and chain length."""
    rng = random.Random(3)
    for _ in range(2000):
        vocab = rng.choice([2, 3, 7, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 50))]
        k, max_n = rng.randrange(0, 9), rng.randrange(1, 5)
        min_n = rng.randrange(1, max_n + 1)
        assert ngram_lookup_array(tokens, k, max_n, min_n) == ngram_lookup(tokens, k, max_n, min_n), (tokens, k)


class _Row:
    """What ``free_chain`` reads of a request: its tokens, prompt, max_new_tokens and whether it ended."""

    def __init__(self, tokens: list[int], max_new_tokens: int) -> None:
        from types import SimpleNamespace

        self.tokens, self.prompt_ids, self.finished = tokens, tokens[:], False
        self.params = SimpleNamespace(max_new_tokens=max_new_tokens)


def test_free_chain_follows_a_growing_text():
    """``NgramDrafter.free_chain`` (its copy of each row's text extended as the row grows, past its first capacity)
    gives ``ngram_lookup``'s chain of the row's current text, cut to the tokens still to come; the copies of rows that
    ended are dropped once their number has doubled."""
    rng = random.Random(4)
    drafter = NgramDrafter(k=8)
    rows = [_Row([rng.randrange(5) for _ in range(rng.randrange(2, 40))], 400) for _ in range(3)]
    for step in range(420):
        row = rows[step % 3]
        room = row.params.max_new_tokens + len(row.prompt_ids) - len(row.tokens) - 1
        assert drafter.free_chain(row, 8) == ngram_lookup(row.tokens, min(8, max(room, 0))), step
        for r in rows:
            r.tokens.append(rng.randrange(5))
    assert len(drafter._texts) == 3
    for row in rows:
        row.finished = True
    for _ in range(70):  # new rows: the ended ones' copies go once 64 are kept
        drafter.free_chain(_Row([1, 2, 1], 4), 2)
    assert not any(r in drafter._texts for r in rows)


def test_reference_extends_the_history_then_looks_up():
    """One row by hand: pending token 2 at position 4 of [7, 1, 2, 3, 2]; the verify accepts node 2 then node 3
    (tokens 1, 2) and its bonus token is 3, so the history is [7, 1, 2, 3, 2, 1, 2, 3]: the suffix (1, 2, 3) last
    occurred at 1, followed by 2, 1, 2, 3 (the continuation stops at the history's end)."""
    hist = torch.zeros(2, 12, dtype=torch.int32)
    hist[1, :5] = torch.tensor([7, 1, 2, 3, 2])
    ids = torch.tensor([[2, 9, 1, 2]])
    positions = torch.tensor([[4, 5, 6, 7]])
    accept = torch.tensor([[2, 3, 2, 3, 0, 1, 1]])
    out = ngram_follow_reference(hist, torch.tensor([1]), ids, positions, accept, k=6)
    assert hist[1, :8].tolist() == [7, 1, 2, 3, 2, 1, 2, 3]
    assert out[0].tolist() == [2, 3, 2, 3, 0, 1, 1, 4, 2, 1, 2, 3, 0, 0]
    assert ngram_lookup([7, 1, 2, 3, 2, 1, 2, 3], 6) == [2, 1, 2, 3]


def _engine(target, device: bool | None, shared: bool = False, **kw) -> SpecEngine:
    return SpecEngine("ngram", target, SpecConfig(tree="chain:5", num_blocks=256, block_size=8, max_batch_size=4,
                                                  prefix_cache=False, cuda_graphs=True, adaptive=False,
                                                  ngram_shared=shared, ngram_device=device, **kw))


def _recorded(monkeypatch) -> tuple[list[int], list[list[list[int]]]]:
    """Counts host lookups (``NgramIndex.lookup_unrolled`` calls) into the first returned list and appends each
    step's proposed chains to the second."""
    calls, chains = [0], []
    lookup, propose = NgramIndex.lookup_unrolled, NgramDrafter.propose

    def counted(self, *a, **kw):
        calls[0] += 1
        return lookup(self, *a, **kw)

    def recorded(self, rows):
        out = propose(self, rows)
        chains.append([t.host.tokens for t in out.trees])
        return out

    monkeypatch.setattr(NgramIndex, "lookup_unrolled", counted)
    monkeypatch.setattr(NgramDrafter, "propose", recorded)
    return calls, chains


def _stop_case(tiny_target):
    """Eight requests of lengths 12-29 (one stopped early by a token), their target-only outputs."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 40) for _ in range(rng.randrange(6, 20))] * 2 for _ in range(8)]
    params = [SamplingParams(max_new_tokens=rng.randrange(12, 30), ignore_eos=True) for _ in prompts]
    plain = SpecEngine(None, tiny_target, SpecConfig(num_blocks=256, block_size=8))
    ref = plain.generate(prompts, params)
    params[2] = SamplingParams(max_new_tokens=params[2].max_new_tokens, stop_token_ids=(ref[2].token_ids[5],),
                               ignore_eos=True)
    ref[2] = plain.generate([prompts[2]], params[2])[0]
    assert len(ref[2].token_ids) < params[2].max_new_tokens
    return prompts, params, [r.token_ids for r in ref]


@pytest.mark.parametrize("budgets,pipeline", [(None, False), ([5, 0, 0, 3, 5], False), ([5, 0, 0, 3, 5], True)])
def test_device_chains_are_the_host_lookups_of_the_same_text(tiny_target, monkeypatch, budgets, pipeline):
    """Eight requests through four rows (rows join as others finish, block-table rows are reused, one request
    stops early on a token), chains looked up on the device (``device_only``): the outputs are target-only's and
    the host's (no device lookups), the host looks up and indexes nothing, and every chain proposed is the host
    lookup (``ngram_lookup``'s scan) of the row's text at that step, cut to the budget and the tokens still to
    come. A row proposes no chain where the device has none for it: its first step, and with budgets 5, 0, 0, 3, 5
    held three steps each (pipelined or not), the first step after decode steps, which run no follow-up (its
    follow-up catches the histories up); never after a step that speculated."""
    from test_pipelined_budgets import ScriptedBudget

    from specdec.drafters.ngram import _most

    prompts, params, ref = _stop_case(tiny_target)
    calls, _ = _recorded(monkeypatch)
    steps = []  # per step: its budget and, per row, (request, its tokens, the most chain tokens, the chain proposed)
    propose, index_update = NgramDrafter.propose, NgramIndex.update

    def recorded(self, rows):
        out = propose(self, rows)
        steps.append((self.node_budget, [(r, list(r.tokens), _most(r, self.node_budget), t.host.tokens)
                                         for r, t in zip(rows, out.trees)]))
        return out

    def update(self, *a, **kw):
        calls[0] += 1
        return index_update(self, *a, **kw)

    monkeypatch.setattr(NgramDrafter, "propose", recorded)
    monkeypatch.setattr(NgramIndex, "update", update)
    outs = {}
    for device in (False, True):
        calls[0] = 0
        steps.clear()
        eng = _engine(tiny_target, device, pipeline=pipeline and device)
        if budgets:
            eng.adaptive = ScriptedBudget(budgets, every=3)
        outs[device] = [r.token_ids for r in eng.generate(prompts, params)]
        if device:
            assert eng.drafter.device_only and eng.verifier.followup.launches > 0
    assert outs[True] == outs[False] == ref
    assert calls[0] == 0  # the device-only engine's host looked nothing up and indexed nothing
    compared, last_budget, none_where_host_has = 0, {}, 0
    for budget, rows in steps:
        for req, tokens, most, chain in rows:
            want = ngram_lookup(tokens, most) if budget else []
            if chain:
                assert chain == want, (tokens, chain, want)
                compared += len(chain)
            elif want:  # no device chain: the row's first step, or the first after a decode step
                none_where_host_has += 1
                assert last_budget.get(req, 0) == 0, (tokens, want)
            last_budget[req] = budget
    assert compared > (20 if budgets else 30) and none_where_host_has <= len(prompts) + (3 * 4 if budgets else 0)


def test_auto_stays_on_the_host_below_its_batch_size(tiny_target, monkeypatch):
    """``ngram_device`` None on the CPU: no device histories at all; forced on with the shared table: outputs stay
    target-only's (the device drafts from the row's own text)."""
    prompts = [[5, 17, 99, 23, 4, 42, 8, 77] * 2, [9, 3, 4, 9, 3, 4, 11]]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ref = SpecEngine(None, tiny_target, SpecConfig(num_blocks=256, block_size=8)).generate(prompts, params)
    auto = _engine(tiny_target, None, shared=True)
    assert auto.verifier.followup is None and auto.drafter.device_chains is None
    forced = _engine(tiny_target, True, shared=True)
    assert [r.token_ids for r in forced.generate(prompts, params)] == [r.token_ids for r in ref]
    assert forced.verifier.followup.launches > 0


def test_sampled_rows_keep_the_host_lookup(tiny_target):
    """A step with a sampled row queues no device lookup (its outcome is decided after the graph), and a greedy
    request beside a sampled one still gets target-only's tokens."""
    prompts = [[5, 17, 99, 23, 4, 42, 8, 77] * 2, [9, 3, 4, 9, 3, 4, 11]]
    greedy = SamplingParams(max_new_tokens=16, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.8, seed=1)
    ref = SpecEngine(None, tiny_target, SpecConfig(num_blocks=256, block_size=8)).generate([prompts[0]], greedy)[0]
    eng = _engine(tiny_target, True)
    out = eng.generate(prompts, [greedy, sampled])
    assert out[0].token_ids == ref.token_ids
    assert eng.verifier.followup.launches == 0


def test_rows_longer_than_the_history_buffer_stay_on_the_host(tiny_target):
    """A buffer too short for a row's tokens plus a verify: no device lookup (nothing written past a row), and
    outputs stay target-only's."""
    prompts = [[5, 17, 99, 23, 4, 42, 8, 77] * 2]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = SpecEngine(None, tiny_target, SpecConfig(num_blocks=256, block_size=8)).generate(prompts, params)
    eng = _engine(tiny_target, True)
    follow = eng.verifier.followup
    follow.hist = follow.hist[:, :17]  # 16 prompt tokens + the first output token + any verify no longer fit
    assert [r.token_ids for r in eng.generate(prompts, params)] == [r.token_ids for r in ref]
    assert follow.launches == 0


def test_ngram_device_must_be_none_or_a_bool():
    with pytest.raises(FieldError, match="ngram_device"):
        SpecConfig(ngram_device="on")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_device_lookup_with_captured_graphs(tiny_dirs, monkeypatch):
    """float32 on CUDA, graphs captured, 16 rows (the auto mode's lookup runs on the device, pipelined): outputs
    equal eager target-only decoding and the proposed chains equal the host lookup's (no shared table) step for
    step unpipelined (pipelined, less a row's first chain), with varied lengths so rows finish at their limits and
    the pipeline is dropped and resumed; then one request alone with the device lookup forced on (pipelined at
    batch 1), and pipelined target-only decoding of them all."""
    from specdec.loading.registry import load_model

    target = load_model(tiny_dirs["llama"], device="cuda")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 40) for _ in range(rng.randrange(6, 40))] * 2 for _ in range(24)]
    params = [SamplingParams(max_new_tokens=rng.randrange(30, 60), ignore_eos=True) for _ in prompts]
    # (rows admitted one by one in every engine, so that their steps hold the same rows)
    base = dict(num_blocks=1024, block_size=16, prefix_cache=False, device="cuda", max_batch_size=16,
                admit_min_free=1)
    ref = SpecEngine(None, target, SpecConfig(cuda_graphs=False, **base)).generate(prompts, params)
    _, chains = _recorded(monkeypatch)
    proposed = {}
    for device, pipeline in ((False, None), (None, False), (None, None)):
        eng = SpecEngine("ngram", target, SpecConfig(tree="chain:8", cuda_graphs=True, adaptive=False,
                                                     ngram_shared=False, ngram_device=device, pipeline=pipeline,
                                                     **base))
        chains.clear()  # (after the warm-up's steps)
        assert [r.token_ids for r in eng.generate(prompts, params)] == [r.token_ids for r in ref]
        proposed[device, pipeline] = list(chains)
        follow, pipe = eng.verifier.followup, eng.pipeline
        if device is None:  # pipelined, the device lookup serves every batch size (unpipelined: from 8 rows)
            assert follow.launches > 0 and follow.min_rows == (1 if pipeline is None else 8)
            assert (pipe.adopted > follow.launches // 3) if pipeline is None else pipe is None
            assert pipeline is False or pipe.hook.advance.graphs  # the queued steps' inputs were written by a graph
    assert proposed[None, False] == proposed[False, None]
    # pipelined, the device serves every step (``device_only``): a row's first step proposes no chain (the CPU
    # test checks each chain against the host lookup of the same text); the rest is the host's
    tokens = {k: sum(len(c) for step in v for c in step) for k, v in proposed.items()}
    assert tokens[None, None] > 0.8 * tokens[False, None]
    eng = SpecEngine("ngram", target, SpecConfig(tree="chain:8", cuda_graphs=True, adaptive=False,
                                                 ngram_device=True, **base))
    assert eng.generate([prompts[0]], params[0])[0].token_ids == ref[0].token_ids
    assert eng.pipeline.adopted > 0
    decode = SpecEngine(None, target, SpecConfig(cuda_graphs=True, pipeline=True, **base))  # pipelined target-only
    assert [r.token_ids for r in decode.generate(prompts, params)] == [r.token_ids for r in ref]
    assert decode.pipeline.adopted > decode.verifier.followup.launches // 2
    assert decode.pipeline.hook.advance.graphs  # the queued steps' inputs were written by a graph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pipelined_sampled_rows_with_captured_graphs(tiny_dirs):
    """float32 on CUDA, graphs captured, 16 rows of which a third seeded and sampled (T=0.7 top-p 0.9, T=1.0):
    pipelined n-gram and target-only steps give the unpipelined engines' tokens, adopt queued steps, and the queued
    steps' rule is a captured graph (kind "chains") whose outcome the follow-up graph and the writer's graph read."""
    from specdec.loading.registry import load_model

    target = load_model(tiny_dirs["llama"], device="cuda")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 40) for _ in range(rng.randrange(6, 40))] * 2 for _ in range(24)]
    params = [SamplingParams(max_new_tokens=rng.randrange(30, 60), ignore_eos=True, seed=i,
                             **({} if i % 3 else dict(temperature=0.7, top_p=0.9) if i % 2 else dict(temperature=1.0)))
              for i in range(len(prompts))]
    base = dict(num_blocks=1024, block_size=16, prefix_cache=False, device="cuda", max_batch_size=16,
                admit_min_free=1, cuda_graphs=True, adaptive=False)
    for proposer, extra in (("ngram", dict(tree="chain:8", ngram_shared=False, ngram_device=True)), (None, {})):
        outs = {}
        for pipeline in (False, True):
            eng = SpecEngine(proposer, target, SpecConfig(pipeline=pipeline, **extra, **base))
            outs[pipeline] = _generated(eng, prompts, params)
            assert eng.all_blocks_free()
        assert outs[True] == outs[False]
        assert eng.pipeline.adopted > 0 and eng.pipeline.hook.advance.graphs
        assert any(key[0] == "chains" for key in eng.verifier.sampled_rule.graphs)


def test_a_history_row_taken_over_is_uploaded_again():
    """Request A's history sits in block-table row 0; A is preempted and B takes row 0; when A gets row 0 back, its
    whole history is uploaded again (B's tokens there are not taken for A's); a commit cut short (a stop) keeps
    the valid prefix."""
    from types import SimpleNamespace

    from specdec.drafters.ngram_device import DeviceNgram

    class Req:  # identity-hashed, like Request
        def __init__(self, tokens, bt_row):
            self.tokens, self.bt_row, self.finished = tokens, bt_row, False

    runner = SimpleNamespace(device=torch.device("cpu"), graphs=None)
    dev = DeviceNgram(runner, max_rows=2, max_len=32, k=4, max_n=4, min_n=1)
    a = Req([1, 2, 3, 4, 5], 0)
    dev._catch_up([a])
    assert dev.hist[0, :5].tolist() == [1, 2, 3, 4, 5]
    dev.hist[0, 5:8] = torch.tensor([6, 7, 8], dtype=torch.int32)  # a follow-up appended path 6, 7 and bonus 8
    dev.consume([a], [[2, 8, 1, 2, 3, 1, 2, 4, 4, 0, 0]])  # before the commit: a holds 5 + 2 + 1 tokens now
    assert dev.held[a] == 8 and dev.chains[a] == (8, [4, 4])
    a.tokens += [6, 7]  # the commit stopped at 7 (a stop token): 8 is not a's
    dev.committed([a])
    assert dev.held[a] == 7
    a.tokens += [11]
    dev._catch_up([a])
    assert dev.hist[0, :8].tolist() == [1, 2, 3, 4, 5, 6, 7, 11]
    b = Req([9, 9, 9], 0)
    dev._catch_up([b])
    assert dev.hist[0, :3].tolist() == [9, 9, 9]
    dev._catch_up([a])  # a back on row 0
    assert dev.hist[0, :8].tolist() == [1, 2, 3, 4, 5, 6, 7, 11]


def test_plan_rules_on_cuda_and_cpu():
    """``resolve_plan``'s auto rules, checked without a GPU: on CUDA the controller for every proposer (target-only
    has nothing to budget), holding budgets for epochs where steps are pipelined (n-gram, EAGLE), every proposer but
    a Llama draft pipelined, n-gram chains on the device from one row when pipelined; under tensor parallelism
    the controller only where it holds budgets for epochs (rank 0's choice broadcast as each ends), the rest as on
    one GPU;
    on the CPU all of it off; explicit options win."""
    from specdec.engine import SpecConfig
    from specdec.plan import NGRAM_DEVICE_MIN_ROWS, resolve_plan

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    ngram = resolve_plan(SpecConfig(tree="chain:8"), cuda, "ngram", "triton", 8)
    assert ngram.adaptive and ngram.pipeline and ngram.budget_epochs and ngram.ngram_device
    assert ngram.ngram_min_rows == 1
    fixed = resolve_plan(SpecConfig(tree="chain:8", adaptive=False), cuda, "ngram", "triton", 8)
    assert not fixed.adaptive and fixed.pipeline and not fixed.budget_epochs
    steered = resolve_plan(SpecConfig(tree="chain:8", adaptive=True), cuda, "ngram", "triton", 8)
    assert steered.adaptive and not steered.pipeline
    none = resolve_plan(SpecConfig(), cuda, "none", "triton", 0)
    assert not none.adaptive and none.pipeline and none.padded
    eagle = resolve_plan(SpecConfig(tree="dynamic:31"), cuda, "eagle", "triton", 31)
    assert eagle.adaptive and eagle.pipeline and eagle.fused_verify and eagle.budget_epochs
    tp = resolve_plan(SpecConfig(tree="dynamic:31", tensor_parallel_size=2), cuda, "eagle", "triton", 31)
    assert tp.adaptive and tp.pipeline and tp.fused_verify and tp.padded and tp.budget_epochs
    tp_draft = resolve_plan(SpecConfig(tree="topk:2x3", tensor_parallel_size=2), cuda, "draft", "triton", 6)
    assert not tp_draft.adaptive and not tp_draft.pipeline
    draft = resolve_plan(SpecConfig(tree="topk:2x3"), cuda, "draft", "triton", 6)
    assert draft.adaptive and not draft.pipeline and not draft.device_program
    for proposer, nodes in (("none", 0), ("ngram", 8), ("eagle", 31)):
        plan = resolve_plan(SpecConfig(tree="chain:8" if proposer == "ngram" else "dynamic:31"), cpu, proposer,
                            "triton", nodes)
        assert not (plan.adaptive or plan.pipeline or plan.padded or plan.ngram_device), plan
    unpiped = resolve_plan(SpecConfig(tree="chain:8", pipeline=False), cuda, "ngram", "triton", 8)
    assert not unpiped.pipeline and unpiped.ngram_min_rows == NGRAM_DEVICE_MIN_ROWS
    assert not resolve_plan(SpecConfig(pipeline=False), cuda, "none", "triton", 0).pipeline
    with pytest.raises(ValueError, match="Triton"):
        resolve_plan(SpecConfig(cuda_graphs=True), cuda, "none", "torch", 0)
    assert "pipeline" in none.describe() and none.as_dict()["proposer"] == "none"


def _checked_queued(monkeypatch) -> tuple[list[int], list, list[int]]:
    """Compares every adopted queued verify's inputs, as the device advance wrote them, with what the host packs for
    the adopting rows' trees: the whole bucket (padding rows, query starts) when all its rows adopt it, else those
    rows. Returns ([adopted steps checked], [mismatches], [adoptions by some rows]); the mismatches are collected
    (asserted by the caller: the engine isolates a step's errors)."""
    from specdec import pipeline_hooks as pipeline
    from specdec.step_inputs import StepInputs
    from specdec.verifier import Verifier, _packed

    built, checked, wrong, partial = {}, [0], [], [0]
    advance, verify_proposal = pipeline.ngram_advance_reference, Verifier.verify_proposal

    def recorded_advance(views, b, q, out, tables, bs):
        advance(views, b, q, out, tables, bs)
        built[(0, b, q)] = {name: getattr(views, name).clone() for name in views._fields}

    def compared(self, rows, proposal):
        queued = proposal.device
        if isinstance(queued, pipeline.QueuedStep):  # what the host would have packed for these rows' trees
            _, b, q = queued.key
            bt = self.runner.tables.host_rows([r.bt_row for r in rows])
            lengths = [len(t.host.tokens) + 1 for t in proposal.trees]
            host = StepInputs(b, q, bt.shape[1], "cpu")
            host.fill_packed(b, q, _packed(rows, proposal.trees, lengths, q, bt, self.runner.pool.block_size), bt)
            views, bs, some = host.views(b, q), self.runner.pool.block_size, queued.sel is not None
            src = torch.as_tensor(queued.sel) if some else torch.arange(b)
            dst = torch.arange(len(rows)) if some else torch.arange(b)
            for name, dev in built[queued.key].items():
                want = getattr(views, name)
                if name != "qsl":
                    dev, want = dev.view(b, -1)[src], want.view(b, -1)[dst]
                if name == "block_tables":  # blocks the scheduler added since the step was queued are not read
                    keep = torch.arange(want.shape[1]) < -(-views.seq_lens[dst] // bs)[:, None]
                    dev, want = dev * keep, want * keep
                if not (name == "qsl" and some or torch.equal(dev, want)):
                    wrong.append((name, dev.tolist(), want.tolist()))
            checked[0] += 1
            partial[0] += some
        return verify_proposal(self, rows, proposal)

    monkeypatch.setattr(pipeline, "ngram_advance_reference", recorded_advance)
    monkeypatch.setattr(Verifier, "verify_proposal", compared)
    return checked, wrong, partial


def test_pipelined_steps_equal_unpipelined_ones(tiny_target, monkeypatch):
    """Pipelined (each greedy step's successor built and queued on the device before the host reads the step):
    the same chains step for step and target-only's outputs, with rows joining, finishing at their length limits
    (chains cut there) and stopping on a token; most steps are adopted, also by the rows left when others finished
    (their successor then queued in a smaller bucket when one fits), and the queued verify's inputs are exactly
    what the host packs for the adopting rows' chains (the whole bucket when all its rows adopt it)."""
    from specdec.cli.bench import engine_mode

    prompts, params, ref = _stop_case(tiny_target)
    _, chains = _recorded(monkeypatch)
    checked, wrong, partial = _checked_queued(monkeypatch)
    outs, proposed = {}, {}
    for pipeline in (False, True):
        chains.clear()
        eng = _engine(tiny_target, True, pipeline=pipeline)
        assert eng.drafter.pipelined == engine_mode(eng)["pipelined"] == pipeline
        outs[pipeline] = [r.token_ids for r in eng.generate(prompts, params)]
        proposed[pipeline] = list(chains)
        pipe = eng.pipeline
        assert wrong == [], wrong[:2]
        if pipeline:
            assert pipe.adopted == checked[0] > len(proposed[True]) // 2
            assert partial[0] > 0  # rows finished: the others adopted the queued verify, and its successor queued
            assert pipe.joined > 0  # rows whose prefill ended joined a queued chain step (their chains as above)
            # (the last step's successor is left queued: no step came to adopt or drop it)
            assert pipe.queued - pipe.adopted - pipe.dropped in (0, 1)
        else:
            assert pipe is None and eng.verifier.followup.launches > 0
    assert outs[True] == outs[False] == ref
    assert proposed[True] == proposed[False]
    assert eng.all_blocks_free()


def test_pipelined_target_only_decoding(tiny_target, monkeypatch):
    """No draft, ``pipeline=True``: each graphed decode step queues the next (the bonus token as its pending token)
    before the host reads it; outputs equal unpipelined decoding with rows joining, finishing and stopping on a
    token, and every adopted step's inputs are what the host packs."""
    prompts, params, ref = _stop_case(tiny_target)
    checked, wrong, partial = _checked_queued(monkeypatch)
    eng = SpecEngine(None, tiny_target, SpecConfig(num_blocks=256, block_size=8, max_batch_size=4, prefix_cache=False,
                                                   cuda_graphs=True, pipeline=True))
    assert eng.drafter.lookahead == 1  # the queued step writes the pending token's KV one position on
    assert [r.token_ids for r in eng.generate(prompts, params)] == ref
    assert wrong == [], wrong[:2]
    assert eng.pipeline.adopted == checked[0] > sum(len(r) for r in ref) // 8 and partial[0] > 0
    assert eng.all_blocks_free()
    auto = SpecEngine(None, tiny_target, SpecConfig(num_blocks=64, block_size=8, cuda_graphs=True))
    assert auto.verifier.followup is None and auto.drafter.lookahead == 0  # opt-in for now (not on by default)


def _sampled_case(tiny_target):
    """``_stop_case``'s eight requests (lengths 12-29, one stopped early by a token; four at a time, so rows finish
    at different steps and new rows join) with four of them seeded and sampled: T=0.7 top-p 0.9 and T=1.0."""
    prompts, params, ref = _stop_case(tiny_target)
    for i, (t, p) in zip((0, 3, 5, 6), ((0.7, 0.9), (1.0, 1.0), (0.7, 0.9), (1.0, 1.0))):
        params[i] = SamplingParams(max_new_tokens=params[i].max_new_tokens, temperature=t, top_p=p, seed=10 + i,
                                   ignore_eos=True)
    return prompts, params, ref


def _sampled_engine(target, proposer: str | None, pipeline: bool) -> SpecEngine:
    if proposer == "ngram":
        return _engine(target, True, pipeline=pipeline)
    return SpecEngine(None, target, SpecConfig(num_blocks=256, block_size=8, max_batch_size=4, prefix_cache=False,
                                               cuda_graphs=True, pipeline=pipeline))


def _generated(eng: SpecEngine, prompts, params) -> list[list[int]]:
    """The requests' tokens, none failed."""
    got = eng.generate(prompts, params)
    assert [r.error for r in got] == [None] * len(got)
    return [r.token_ids for r in got]


@pytest.mark.parametrize("proposer", ["ngram", None])
def test_pipelined_sampled_rows_equal_unpipelined_ones(tiny_target, monkeypatch, proposer):
    """Steps with seeded sampled rows are pipelined too (n-gram chains on the device, and target-only decoding): the
    queued step's rule reads its rows' positions from the queued inputs and its advance reads the rule's bonus
    token, so every request's tokens equal the unpipelined engine's, greedy rows target-only's, with rows joining,
    finishing and stopping on a token; batches of sampled rows only adopt queued steps, whose inputs are exactly
    what the host packs."""
    prompts, params, ref = _sampled_case(tiny_target)
    checked, wrong, partial = _checked_queued(monkeypatch)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    outs = {}
    for pipeline in (False, True):
        eng = _sampled_engine(tiny_target, proposer, pipeline)
        outs[pipeline] = _generated(eng, prompts, params)
        adopted = 0 if eng.pipeline is None else eng.pipeline.adopted
        alone = [params[i] for i in sampled]
        outs[pipeline, "sampled"] = [r.token_ids for r in eng.generate([prompts[i] for i in sampled], alone)]
        if pipeline:  # the batch of sampled rows alone was pipelined
            assert eng.pipeline.adopted > adopted + sum(p.max_new_tokens for p in alone) // 8
        assert wrong == [], wrong[:2]
        assert eng.all_blocks_free()
    assert outs[True] == outs[False]
    assert outs[True, "sampled"] == outs[False, "sampled"] == [outs[True][i] for i in sampled]
    assert [outs[True][i] for i in range(len(ref)) if i not in sampled] == [
        ref[i] for i in range(len(ref)) if i not in sampled]
    assert checked[0] > 0 and partial[0] > 0


@pytest.mark.parametrize("proposer", ["ngram", None])
def test_a_row_with_a_repetition_penalty_rides_in_queued_steps(tiny_target, proposer):
    """Rows with a repetition penalty (sampled or greedy) ride in queued steps (whose rule counts the tokens the step
    before commits) and give the unpipelined engine's tokens beside pipelined greedy and sampled rows, alone and in
    the batch."""
    prompts, params, _ = _sampled_case(tiny_target)
    params[1] = SamplingParams(max_new_tokens=params[1].max_new_tokens, temperature=0.7, top_p=0.9, seed=3,
                               repetition_penalty=1.3, ignore_eos=True)
    params[2] = SamplingParams(max_new_tokens=30, repetition_penalty=1.2, ignore_eos=True)
    outs = {}
    for pipeline in (False, True):
        eng = _sampled_engine(tiny_target, proposer, pipeline)
        outs[pipeline] = _generated(eng, prompts, params)
        outs[pipeline, "alone"] = [r.token_ids for r in eng.generate(prompts[1:3], params[1:3])]
        if pipeline:
            adopted = eng.pipeline.adopted
            eng.generate(prompts[1:3], params[1:3])
            assert eng.pipeline.adopted > adopted
        assert eng.all_blocks_free()
    assert outs[True] == outs[False]
    assert outs[True, "alone"] == outs[False, "alone"] == outs[True][1:3]
