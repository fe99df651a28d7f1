"""SmolLM2-135M end to end: greedy output equals transformers ``generate``; stop rules; streaming.

References are computed once per session (conftest: ``smollm2_hf_greedy``, ``smollm2_target_only``).
"""

from __future__ import annotations

import pytest

from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]
NEW = 32  # == conftest.SMOLLM2_NEW_TOKENS, checked below


@pytest.fixture(scope="module", autouse=True)
def _same_budget(smollm2_new_tokens):
    assert smollm2_new_tokens == NEW


@pytest.fixture(scope="module")
def engine(smollm2):
    """One target-only engine shared by the tests of this module (it must drain after every call)."""
    return SpecEngine(None, smollm2, SpecConfig(num_blocks=256))


def _check_finish(out, ref, eos):
    assert out.error is None
    if ref[-1] in eos:
        assert out.finish_reason == "stop"
    else:
        assert len(ref) == NEW
        assert out.finish_reason == "length"


def test_greedy_batch_of_8_matches_transformers(smollm2_target_only, smollm2_hf_greedy, chat_prompt_ids,
                                                smollm2_eos):
    assert len({len(p) for p in chat_prompt_ids}) >= 6  # mixed lengths
    for i, (out, ref) in enumerate(zip(smollm2_target_only, smollm2_hf_greedy, strict=True)):
        assert out.prompt_token_ids == chat_prompt_ids[i]
        assert out.token_ids == ref, f"prompt {i}"
        _check_finish(out, ref, smollm2_eos)
    # both stop rules occur among the references, so both are exercised
    reasons = {o.finish_reason for o in smollm2_target_only}
    assert reasons == {"stop", "length"}


def test_greedy_batch_size_1_matches_transformers(smollm2, smollm2_hf_greedy, chat_prompt_ids, smollm2_eos):
    eng = SpecEngine(None, smollm2, SpecConfig(num_blocks=64, max_batch_size=1))
    outs = eng.generate(chat_prompt_ids, SamplingParams(max_new_tokens=NEW))
    for i, (out, ref) in enumerate(zip(outs, smollm2_hf_greedy, strict=True)):
        assert out.token_ids == ref, f"prompt {i}"
        _check_finish(out, ref, smollm2_eos)
    assert eng.all_blocks_free()


def test_seeded_sampling_same_alone_and_in_batch(engine, chat_prompt_ids):
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_new_tokens=16, ignore_eos=True)
    alone = engine.generate([chat_prompt_ids[1]], sampled)[0]
    others = [SamplingParams(max_new_tokens=10), sampled,
              SamplingParams(temperature=1.0, seed=7, max_new_tokens=20, ignore_eos=True)]
    batch = engine.generate([chat_prompt_ids[3], chat_prompt_ids[1], chat_prompt_ids[6]], others)
    assert len(alone.token_ids) == 16
    assert batch[1].token_ids == alone.token_ids
    again = engine.generate([chat_prompt_ids[1]], sampled)[0]
    assert again.token_ids == alone.token_ids
    other_seed = engine.generate([chat_prompt_ids[1]], SamplingParams(
        temperature=0.9, top_p=0.9, seed=4321, max_new_tokens=16, ignore_eos=True))[0]
    assert other_seed.token_ids != alone.token_ids  # the seed matters
    assert engine.all_blocks_free()


def test_eos_ends_request_with_stop(engine, smollm2_target_only, smollm2_hf_greedy, chat_prompt_ids,
                                    smollm2_eos, smollm2):
    idx = [i for i, ref in enumerate(smollm2_hf_greedy) if ref[-1] in smollm2_eos]
    assert idx, "no reference prompt ends with EOS within the token budget"
    for i in idx:
        out = smollm2_target_only[i]
        assert out.finish_reason == "stop"
        assert out.token_ids[-1] in smollm2_eos
        assert not set(out.token_ids[:-1]) & smollm2_eos
        assert len(out.token_ids) < NEW
        assert "<|im_end|>" not in out.text
        assert out.text == smollm2.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    # with ignore_eos the same request runs past the EOS to max_new_tokens
    i = idx[0]
    n = len(smollm2_hf_greedy[i]) + 3
    out = engine.generate([chat_prompt_ids[i]], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == n
    assert out.token_ids[:len(smollm2_hf_greedy[i])] == smollm2_hf_greedy[i]
    assert engine.all_blocks_free()


def test_stop_string_ends_request_and_is_cut(engine, smollm2, smollm2_hf_greedy, chat_prompt_ids):
    tok = smollm2.tokenizer
    i = next(i for i, r in enumerate(smollm2_hf_greedy) if len(r) == NEW)
    ref = smollm2_hf_greedy[i]
    text = tok.decode(ref, skip_special_tokens=True)
    # a stop string from the middle of the greedy text, first occurrence there
    mid = len(text) // 2
    stop = text[mid:mid + 4]
    assert stop.strip(), text
    cut = text.find(stop)
    # the request ends at the first token whose decoded output contains the stop string
    j = next(j for j in range(1, len(ref) + 1) if stop in tok.decode(ref[:j], skip_special_tokens=True))
    out = engine.generate([chat_prompt_ids[i]], SamplingParams(max_new_tokens=NEW,
                                                               stop=[stop, "@@never@@"]))[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text
    assert out.text == text[:cut]
    assert out.token_ids == ref[:j]
    assert len(out.token_ids) < len(ref)
    assert engine.all_blocks_free()


def test_max_new_tokens_gives_length(engine, smollm2_hf_greedy, chat_prompt_ids):
    for n in (1, 5):
        outs = engine.generate([chat_prompt_ids[2], chat_prompt_ids[7]],
                               SamplingParams(max_new_tokens=n, ignore_eos=True))
        for out, ref in zip(outs, (smollm2_hf_greedy[2], smollm2_hf_greedy[7]), strict=True):
            assert out.finish_reason == "length"
            assert len(out.token_ids) == n
            assert out.token_ids == ref[:n]
    assert engine.all_blocks_free()


def test_stream_increments_concatenate_to_final(engine, smollm2_hf_greedy, chat_prompt_ids):
    prompts = [chat_prompt_ids[2], chat_prompt_ids[0], chat_prompt_ids[4]]
    params = SamplingParams(max_new_tokens=12)
    toks: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    final = {}
    for out in engine.stream(prompts, params):
        assert out.request_id not in final, "output after the request finished"
        toks.setdefault(out.request_id, []).extend(out.new_token_ids)
        texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
        assert out.token_ids == toks[out.request_id]  # the running total is the concatenation so far
        if out.finished:
            final[out.request_id] = out
    assert len(final) == 3
    refs = [smollm2_hf_greedy[2], smollm2_hf_greedy[0], smollm2_hf_greedy[4]]
    for rid, ref in zip(sorted(final, key=int), refs, strict=True):
        out = final[rid]
        assert toks[rid] == out.token_ids == ref[:12]
        assert texts[rid] == out.text
    assert engine.all_blocks_free()


def test_stream_text_with_a_stop_string_spanning_steps(engine, smollm2, smollm2_hf_greedy, chat_prompt_ids):
    """Streamed text deltas never show characters that the final text drops: a stop string that
    starts in one step and is completed in a later one must not leak its first part."""
    tok = smollm2.tokenizer
    i = next(i for i, r in enumerate(smollm2_hf_greedy) if len(r) == NEW)
    ref = smollm2_hf_greedy[i]
    a, b = tok.decode(ref[:6]), tok.decode(ref[:7])
    stop = a[-2:] + b[len(a):len(a) + 2]  # the end of token 6's text + the start of token 7's
    assert len(stop) == 4 and a.find(stop) < 0
    streamed, toks, final = "", [], None
    for out in engine.stream([chat_prompt_ids[i]], SamplingParams(max_new_tokens=16, stop=[stop])):
        streamed += out.new_text
        toks += out.new_token_ids
        final = out
    assert final.finish_reason == "stop"
    assert final.text == b[:b.find(stop)]
    assert toks == final.token_ids == ref[:7]
    assert streamed == final.text
    assert engine.all_blocks_free()


def test_stream_text_with_multibyte_characters(engine):
    prompt = [{"role": "user", "content": "Reply with three emojis that describe summer."}]
    streamed, final = "", None
    for out in engine.stream([prompt], SamplingParams(max_new_tokens=12)):
        streamed += out.new_text
        final = out
    assert any(ord(c) > 0xFFFF for c in final.text), final.text  # the answer does contain emoji
    assert "\ufffd" not in final.text
    assert "\ufffd" not in streamed
    assert streamed == final.text
    assert engine.all_blocks_free()
