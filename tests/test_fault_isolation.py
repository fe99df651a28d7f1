"""Fault isolation: a fault injected for one request fails only that request (finish_reason "error",
cause in ``error``); its neighbours finish with the tokens they get without the fault, every block is
freed, the prefix cache keeps nothing of the injured request, and the engine goes on serving."""

from __future__ import annotations

import pytest
import torch
from specdec.kvcache.allocator import OutOfBlocks

from specdec.engine import SpecConfig, SpecEngine
from specdec.errors import RequestFault
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

_g = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(3, 190, (13 + 2 * i,), generator=_g).tolist() for i in range(4)]
VICTIM = 1
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
PARAMS = [GREEDY, GREEDY, SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_new_tokens=12, ignore_eos=True),
          GREEDY]
FAULTS = ["target_forward", "target_prefill", "draft_forward", "drafter", "nan_logits", "nan_kv", "out_of_blocks"]


def make_engine(draft, target, **kw) -> SpecEngine:
    return SpecEngine(draft, target, SpecConfig(tree="chain:3", num_blocks=128, block_size=4, **kw))


@pytest.fixture(scope="module")
def reference(tiny_target, tiny_draft):
    outs = make_engine(tiny_draft, tiny_target).generate(PROMPTS, PARAMS)
    assert all(o.finish_reason == "length" for o in outs)
    return [o.token_ids for o in outs]


def _is_victim(req) -> bool:
    return req.prompt_ids == PROMPTS[VICTIM]


def inject(eng: SpecEngine, fault: str, monkeypatch) -> type[Exception]:
    """Install ``fault`` for the victim request; returns the type of the error it must report."""
    forward = eng.runner.forward  # run() and the eager verifier go through forward()

    def faulty_forward(model_idx, model, rows, *rest):  # rest: the verifier's aux_layers
        victim = [r for r in rows if _is_victim(r.req)]
        prefill = bool(victim) and victim[0].want_logits == "none"
        mid = bool(victim) and victim[0].req.num_output >= 3
        if fault == "target_forward" and model_idx == 0 and mid:
            raise RuntimeError("injected: target forward failed")
        if fault == "target_prefill" and model_idx == 0 and prefill:
            raise RuntimeError("injected: target prefill failed")
        if fault == "draft_forward" and model_idx == 1 and mid:
            raise RuntimeError("injected: draft forward failed")
        out = forward(model_idx, model, rows, *rest)
        logits = list(out.logits)
        if fault == "nan_logits" and model_idx == 0 and mid:
            i = rows.index(victim[0])
            logits[i] = torch.full_like(logits[i], float("nan"))
        if fault == "nan_kv" and model_idx == 0 and prefill:  # corrupt the victim's KV: later logits are NaN
            eng.pool.storage[torch.tensor(victim[0].req.blocks)] = float("nan")
        return out._replace(logits=logits)

    monkeypatch.setattr(eng.runner, "forward", faulty_forward)
    forward_packed = eng.runner.forward_packed  # the padded verify step (graphs on)

    def faulty_packed(key, reqs, *rest, **options):
        if fault == "target_forward" and any(_is_victim(r) and r.num_output >= 3 for r in reqs):
            raise RuntimeError("injected: target forward failed")
        return forward_packed(key, reqs, *rest, **options)

    monkeypatch.setattr(eng.runner, "forward_packed", faulty_packed)
    if fault == "drafter":
        propose = eng.drafter.propose

        def faulty_propose(rows):
            if any(_is_victim(r) and r.num_output >= 2 for r in rows):
                raise ValueError("injected: drafter failed")
            return propose(rows)

        monkeypatch.setattr(eng.drafter, "propose", faulty_propose)
    if fault == "out_of_blocks":
        grow = eng.scheduler.allocator_grow

        def faulty_grow(req, num_positions):
            if _is_victim(req) and req.num_output >= 3:
                raise OutOfBlocks(1, 0)
            return grow(req, num_positions)

        monkeypatch.setattr(eng.scheduler, "allocator_grow", faulty_grow)
    return {"nan_logits": RequestFault, "nan_kv": RequestFault, "drafter": ValueError,
            "out_of_blocks": OutOfBlocks}.get(fault, RuntimeError)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("fault", FAULTS)
def test_fault_fails_only_the_injured_request(tiny_target, tiny_draft, reference, fault, graphs, monkeypatch):
    """Eager rows, and the padded static-buffer step (graphs=True), whose non-finite check runs on the device."""
    if graphs and fault == "nan_logits":
        pytest.skip("the padded step checks finiteness on the device, before host-side logits could be edited")
    eng = make_engine(tiny_draft, tiny_target, cuda_graphs=graphs, max_batch_size=4)
    error_type = inject(eng, fault, monkeypatch)
    outs = eng.generate(PROMPTS, PARAMS)
    bad = outs[VICTIM]
    assert bad.finish_reason == "error" and isinstance(bad.error, error_type), (bad.finish_reason, bad.error)
    assert "injected" in str(bad.error) or fault in ("nan_logits", "nan_kv", "out_of_blocks")
    assert bad.token_ids == reference[VICTIM][:len(bad.token_ids)]  # what it produced before the fault is right
    for i, o in enumerate(outs):
        if i != VICTIM:
            assert o.error is None and o.finish_reason == "length"
            assert o.token_ids == reference[i], f"neighbour {i} changed under fault {fault}"
    assert not eng.scheduler.has_work
    monkeypatch.undo()  # the fault is gone: the next request sharing the victim's prefix gets correct output
    again = eng.generate([PROMPTS[VICTIM], PROMPTS[0]], [PARAMS[VICTIM], PARAMS[0]])
    assert [o.token_ids for o in again] == [reference[VICTIM], reference[0]]
    assert eng.all_blocks_free()


@pytest.mark.parametrize("fault", ["drafter", "nan_kv", "out_of_blocks"])
def test_fault_under_pipelined_ngram_steps(tiny_target, fault, monkeypatch):
    """Greedy n-gram steps queued on the device before the host reads the previous one (``drafters.ngram_device``):
    the injured request fails alone while the others adopt the queued verifies without it (or, when the step is
    retried row by row, one at a time), and every neighbour gets target-only's tokens."""
    prompts, params = PROMPTS, SamplingParams(max_new_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in SpecEngine(None, tiny_target, SpecConfig(num_blocks=128, block_size=4)).generate(
        prompts, params)]
    eng = SpecEngine("ngram", tiny_target, SpecConfig(tree="chain:3", num_blocks=128, block_size=4, max_batch_size=4,
                                                      cuda_graphs=True, ngram_device=True, pipeline=True))
    error_type = inject(eng, fault, monkeypatch)
    outs = eng.generate(prompts, params)
    bad = outs[VICTIM]
    assert bad.finish_reason == "error" and isinstance(bad.error, error_type), (bad.finish_reason, bad.error)
    assert bad.token_ids == ref[VICTIM][:len(bad.token_ids)]
    assert [o.token_ids for i, o in enumerate(outs) if i != VICTIM] == [r for i, r in enumerate(ref) if i != VICTIM]
    assert eng.pipeline.adopted > 0 and sum(o.stats.accepted for o in outs) > 0  # queued steps ran real chains
    monkeypatch.undo()
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    assert eng.all_blocks_free()


def test_failed_request_leaves_nothing_in_the_prefix_cache(tiny_target, tiny_draft, monkeypatch):
    eng = make_engine(tiny_draft, tiny_target)
    inject(eng, "nan_kv", monkeypatch)
    cache = eng.scheduler.prefix_cache
    outs = eng.generate([PROMPTS[VICTIM]], GREEDY)
    assert outs[0].finish_reason == "error" and "not finite" in str(outs[0].error)
    assert len(cache) == 0  # the victim's prompt blocks were cached after prefill, then discarded
    assert not torch.isnan(eng.pool.storage).any()  # its poisoned blocks were scrubbed when freed
    outs = eng.generate([PROMPTS[0]], GREEDY)
    assert len(cache) > 0 and outs[0].error is None


def test_every_request_failing_leaves_a_working_engine(tiny_target, tiny_draft, reference, monkeypatch):
    eng = make_engine(tiny_draft, tiny_target)
    run = eng.runner.run
    monkeypatch.setattr(eng.runner, "run", lambda *a: (_ for _ in ()).throw(RuntimeError("device lost")))
    outs = eng.generate(PROMPTS, PARAMS)
    assert all(o.finish_reason == "error" and "device lost" in str(o.error) for o in outs)
    monkeypatch.setattr(eng.runner, "run", run)
    assert [o.token_ids for o in eng.generate(PROMPTS, PARAMS)] == reference
    assert eng.all_blocks_free()


def test_stuck_pool_fails_the_waiting_request(tiny_target, monkeypatch):
    """Blocks vanish from the pool (a leak elsewhere): the request that cannot be admitted fails."""
    eng = SpecEngine(None, tiny_target, SpecConfig(num_blocks=16, block_size=4, prefix_cache=False))
    stolen = eng.allocator.allocate(12)
    outs = eng.generate([PROMPTS[3]], GREEDY)
    assert outs[0].finish_reason == "error" and isinstance(outs[0].error, OutOfBlocks)
    eng.allocator.free(stolen)
    assert eng.generate([PROMPTS[3]], GREEDY)[0].finish_reason == "length"
    assert eng.all_blocks_free()


def test_a_retry_samples_what_the_failed_attempt_would_have(tiny_target, tiny_draft, monkeypatch):
    """Sampled requests whose batch step fails once, and is then retried row by row, give the tokens of a run that
    never failed: the snapshot puts back their counts and tokens, and their noise depends on their keys and
    positions only."""
    params = [PARAMS[2], SamplingParams(temperature=0.8, seed=11, max_new_tokens=12, ignore_eos=True)]
    prompts = [PROMPTS[0], PROMPTS[2]]
    want = [o.token_ids for o in make_engine(tiny_draft, tiny_target).generate(prompts, params)]
    eng = make_engine(tiny_draft, tiny_target)
    verify, calls = eng.verifier.verify_proposal, []

    def flaky(rows, proposal):
        calls.append(len(rows))
        if len(calls) == 3 and len(rows) == 2:
            raise RuntimeError("a transient fault")
        return verify(rows, proposal)

    monkeypatch.setattr(eng.verifier, "verify_proposal", flaky)
    outs = eng.generate(prompts, params)
    assert calls[2:5] == [2, 1, 1], calls  # the batch failed, each row was retried alone
    assert [o.token_ids for o in outs] == want, [o.error for o in outs]
