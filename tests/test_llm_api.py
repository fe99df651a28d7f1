"""``specdec.LLM``: vLLM's offline entry point over the same engine, with vLLM's names for its options."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams, SpecConfig, SpecEngine

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[17, 4, 99, 23, 5], [3, 8, 8, 8, 8, 2]]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def test_vllm_option_names_set_the_engine_config(tiny_target, tiny_draft):
    llm = LLM(model=tiny_target, draft=tiny_draft, max_num_seqs=3, max_num_batched_tokens=96,
              enable_prefix_caching=False, dtype="float", enforce_eager=True, num_blocks=48, block_size=4,
              tree="chain:3")
    cfg = llm.config
    assert (cfg.max_batch_size, cfg.max_num_tokens, cfg.prefix_cache, cfg.dtype, cfg.cuda_graphs) == \
        (3, 96, False, "float32", False)
    assert llm.plan.proposer == "draft"
    assert SpecConfig(dtype="half").dtype == "float16" and SpecConfig(dtype="bf16").dtype == "bfloat16"


def test_generate_under_vllms_argument_name_equals_the_engine(tiny_target, tiny_draft):
    opts = {"num_blocks": 48, "block_size": 4, "tree": "chain:3"}
    got = LLM(tiny_target, draft=tiny_draft, **opts).generate(PROMPTS, sampling_params=GREEDY)
    want = SpecEngine(None, tiny_target, SpecConfig(**opts)).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_speculative_config_names_the_proposer_and_its_tokens(tiny_target):
    llm = LLM(tiny_target, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, num_blocks=48,
              block_size=4)
    assert (llm.plan.proposer, llm.config.tree) == ("ngram", "chain:3")
    with pytest.raises(TypeError, match="num_speculative_tokens"):
        LLM(tiny_target, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(TypeError, match=r"unknown key\(s\) \['draft_tp'\]"):
        LLM(tiny_target, speculative_config={"model": "x", "draft_tp": 2})


def test_an_unknown_option_is_refused_by_name(tiny_target):
    with pytest.raises(TypeError, match="unknown option 'max_model_lenght'.*max_batch_size"):
        LLM(tiny_target, max_model_lenght=512)
    with pytest.raises(TypeError, match="'max_batch_size' twice: as 'max_num_seqs' and as 'max_batch_size'"):
        LLM(tiny_target, max_num_seqs=2, max_batch_size=4)
    with pytest.raises(TypeError, match=r"no option 'seed': a request's seed is SamplingParams\(seed=...\)"):
        LLM(tiny_target, seed=0)
    with pytest.raises(TypeError, match="positional"):  # (vLLM's second positional argument is a tokenizer)
        LLM(tiny_target, tiny_target)


def test_outputs_carry_the_prompt_text(strict_target):
    """vLLM's ``RequestOutput.prompt``: a text prompt itself, a chat's rendered text, None for token ids."""
    llm = LLM(strict_target, draft=None, num_blocks=64, block_size=4)
    text, ids = llm.generate(["hello", [104, 105]], GREEDY)
    assert (text.prompt, ids.prompt) == ("hello", None)
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, n=2, seed=1, temperature=1.0))
    assert chat[0].prompt == strict_target.tokenizer.decode(chat[0].prompt_token_ids) and "hi" in chat[0].prompt
    tok = llm.get_tokenizer()  # (vLLM's: a chat rendered by hand runs as the same ids)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert tok.encode(rendered, add_special_tokens=False) == chat[0].prompt_token_ids


def test_auto_draft_is_ngram_for_a_target_without_a_shipped_draft(tiny_target):
    assert LLM(tiny_target, num_blocks=48, block_size=4).plan.proposer == "ngram"
    assert LLM(tiny_target, draft=None, num_blocks=48, block_size=4).plan.proposer == "none"


def test_chat_takes_one_conversation_or_several(strict_target):
    llm = LLM(strict_target, draft=None, num_blocks=64, block_size=4)
    convo = [{"role": "user", "content": "hi"}]
    one = llm.chat(convo, GREEDY)
    two = llm.chat([convo, [{"role": "user", "content": "yo"}]], GREEDY)
    assert len(one) == 1 and len(two) == 2
    assert one[0].outputs[0].token_ids == two[0].outputs[0].token_ids
    with pytest.raises(TypeError, match="conversation"):
        llm.chat("hi", GREEDY)


def test_vllm_prompt_dicts(tiny_target):
    """vLLM's {"prompt": text} and {"prompt_token_ids": ids}, alone or in a list, run as the text or ids they hold;
    a key the engine does not read is refused by name."""
    from specdec.prompts import PromptError

    llm = LLM(tiny_target, draft=None, num_blocks=64, block_size=4)
    want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    dicts = [{"prompt_token_ids": p} for p in PROMPTS]
    assert [o.token_ids for o in llm.generate(dicts, GREEDY)] == want
    assert llm.generate(dicts[1], GREEDY)[0].token_ids == want[1]
    with pytest.raises(PromptError, match="multi_modal_data"):
        llm.generate({"prompt_token_ids": PROMPTS[0], "multi_modal_data": {}}, GREEDY)


def test_max_tokens_none_generates_until_the_context_is_full(tiny_factory):
    """``max_tokens=None`` (vLLM's: no limit but the model's) is ``max_new_tokens=None``; the engine turns it into
    what the context leaves after the prompt (and the tree's lookahead): ignoring EOS, a request runs to exactly
    there, with finish_reason "length"; an omitted max_tokens stays the default (64)."""
    from specdec.loading.registry import load_model

    assert SamplingParams(max_tokens=None).max_new_tokens is None
    assert SamplingParams(max_new_tokens=None).max_tokens is None
    assert SamplingParams().max_new_tokens == SamplingParams(max_tokens=64).max_new_tokens == 64
    target = load_model(tiny_factory("ctx48", max_position_embeddings=48))
    for draft in (None, "ngram"):
        llm = LLM(model=target, draft=draft, num_blocks=64, block_size=4)
        out = llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=None, ignore_eos=True))[0].outputs[0]
        assert len(out.token_ids) == 48 - 6 - llm.drafter.lookahead and out.finish_reason == "length"


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_max_tokens_none_stops_where_the_pool_is_full(tiny_target, draft):
    """With a KV pool smaller than the context, ``max_tokens=None`` was refused for every prompt ("needs 33 KV
    blocks; the pool has 8, which hold at most 125 new tokens ..., got 510": a number the caller never gave). It now
    runs until the context or the pool is full, whichever comes first."""
    llm = LLM(model=tiny_target, draft=draft, num_blocks=8, block_size=16)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert out.finish_reason == "length", out.error
    assert len(out.outputs[0].token_ids) == 8 * 16 - 3 - llm.drafter.lookahead - 1  # the pool holds p + m + la + 1
    assert llm.all_blocks_free()
