"""The request's logits processors (``SamplingParams.logit_bias``, OpenAI's; ``allowed_token_ids``, ``bad_words``
and ``min_tokens``, vLLM's): greedy output with every proposer and step kind equals a plain reference loop over the
full model's logits with the bias, the allowed set, the bad words and the held-back ending tokens written out;
seeded sampled rows equal target-only decoding's tokens and keep to their allowed set; a row held back by
``min_tokens`` takes the fast paths again once it has that many tokens; stop strings do not end a request before
``min_tokens``; bad values are refused with the field named, by the Python API and by the server."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import PAIR_EOS, TINY_VOCAB
from specdec.scheduler.request import Request
from test_repetition_penalty import CONFIGS, PIPELINED, PROMPTS
from test_spec_sampling import tiny_eagle  # noqa: F401 (the fixture)

from specdec.engine import SpecConfig, SpecEngine
from specdec.errors import FieldError
from specdec.repetition_penalty import ContextPenalty, bad_word_ids, path_depth
from specdec.sampling_params import SamplingParams
from specdec.serving.protocol import BadRequest, parse_completion

pytestmark = pytest.mark.usefixtures("single_thread")

EOS = PAIR_EOS  # the tiny target's
NEW_TOKENS = 14
ALLOWED = tuple(range(3, TINY_VOCAB, 3))


def _processed(logits: torch.Tensor, output: list[int], options: dict) -> torch.Tensor:
    """(V,) ``logits`` with the processors written out: -inf outside the allowed ids, the biases added, the ending
    tokens -inf while the output is shorter than min_tokens."""
    x = logits.clone()
    if options.get("allowed_token_ids") is not None:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[list(options["allowed_token_ids"])] = True
        x = torch.where(keep, x, -torch.inf)
    for t, b in (options.get("logit_bias") or {}).items():
        x[t] += b
    if len(output) < options.get("min_tokens", 0):
        x[[EOS, *options.get("stop_token_ids", ())]] = -torch.inf
    return x


def _reference(model, prompt: list[int], options: dict) -> list[int]:
    """Greedy decoding, one full forward per token, until NEW_TOKENS or an ending token (EOS, a stop id)."""
    tokens, ending = list(prompt), {EOS, *options.get("stop_token_ids", ())}
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()  # (V,)
            tokens.append(int(_processed(logits, tokens[len(prompt):], options).argmax()))
            if tokens[-1] in ending:
                break
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def cases(tiny_dirs):
    """(prompts, params, reference outputs): per prompt a row with a bias that bans its plain first token, one
    with an allowed set, one held back by min_tokens (EOS, and a stop id: its plain output's second token); a plain
    row; then two seeded sampled rows (their references: target-only decoding's tokens, in ``target_only``)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dirs["llama"]), dtype=torch.float32).eval()
    prompts, options = [], []
    for p in PROMPTS:
        plain = _reference(hf, p, {})
        prompts += [p, p, p, p]
        options += [{"logit_bias": {plain[0]: -100.0, (plain[0] + 7) % TINY_VOCAB: 1.5}},
                    {"allowed_token_ids": ALLOWED},
                    {"stop_token_ids": (plain[1],), "min_tokens": 6},
                    {}]
    refs = [_reference(hf, p, o) for p, o in zip(prompts, options)]
    plain_refs = [_reference(hf, p, {}) for p in PROMPTS]
    assert all(r != plain_refs[i // 4] for i, r in enumerate(refs) if i % 4 == 0)  # the bias changes the output
    assert all(set(r) <= set(ALLOWED) and r != plain_refs[i // 4] for i, r in enumerate(refs) if i % 4 == 1)
    held = [r for i, r in enumerate(refs) if i % 4 == 2]
    assert all(len(r) >= 6 and plain[1] not in r[:5] for r, plain in zip(held, plain_refs))
    assert any(len(plain) < 6 for plain in plain_refs)  # (an EOS held back: a plain output ends before 6 tokens)
    sampled = [dict(temperature=0.9, seed=5, allowed_token_ids=ALLOWED, logit_bias={ALLOWED[2]: 3.0}),
               dict(temperature=1.0, seed=8, min_tokens=10, stop_token_ids=(ALLOWED[0], ALLOWED[1]))]
    params = [SamplingParams(max_tokens=NEW_TOKENS, **o) for o in options + sampled]
    return [*prompts, PROMPTS[0], PROMPTS[1]], params, refs


@pytest.fixture(scope="module")
def target_only(tiny_target, cases):
    """Every row's tokens from target-only decoding."""
    prompts, params, _ = cases
    eng = SpecEngine(None, tiny_target, SpecConfig(num_blocks=256, block_size=4))
    return [o.token_ids for o in eng.generate(prompts, params)]


@pytest.mark.parametrize("name,options", CONFIGS, ids=[f"{n}-{'-'.join(o) or 'packed'}" for n, o in CONFIGS])
def test_processed_rows_equal_the_reference(tiny_target, tiny_draft, tiny_eagle, cases, target_only,  # noqa: F811
                                            name, options):
    """Every proposer and step kind (float32): the greedy rows equal the reference loop token for token (so
    target-only decoding), the seeded sampled rows target-only decoding's tokens (the first only allowed tokens,
    the second no stop id among its first ten tokens); every block is free afterwards."""
    prompts, params, refs = cases
    draft = {"none": None, "ngram": "ngram", "model": tiny_draft, "eagle": tiny_eagle}[name]
    tree = "chain:3" if name in ("none", "ngram") else "topk:2x2"
    eng = SpecEngine(draft, tiny_target, SpecConfig(tree=tree, num_blocks=256, block_size=4, adaptive=False,
                                                    **options))
    outs = [o.token_ids for o in eng.generate(prompts, params)]
    assert outs[:len(refs)] == refs
    assert outs == target_only
    assert set(outs[-2]) <= set(ALLOWED)
    assert not set(outs[-1][:10]) & {ALLOWED[0], ALLOWED[1]}
    assert eng.all_blocks_free()


@pytest.mark.parametrize("name", ["none", "ngram", "eagle"])
def test_processed_rows_keep_the_batch_pipelined(tiny_target, tiny_eagle, cases, target_only, name):  # noqa: F811
    """Rows with processed logits ride in steps queued on the device, as plain rows do, with the same tokens as
    unpipelined target-only decoding: a bias or an allowed set (the same at every position), and penalties or
    ``min_tokens``, which read the context: a queued step counts the tokens the step before it commits, gathered on
    the device (``committed_ahead``). The penalties change the output, so a queued step that missed those tokens
    would show."""
    prompts, params, refs = cases
    draft = {"none": None, "ngram": "ngram", "eagle": tiny_eagle}[name]
    tree = "chain:3" if name in ("none", "ngram") else "topk:2x2"
    options = dict(PIPELINED, ngram_device=True) if name == "ngram" else PIPELINED

    def run(rows, extra=None, engine_options=options, proposer=draft):
        eng = SpecEngine(proposer, tiny_target, SpecConfig(tree=tree, num_blocks=256, block_size=4, adaptive=False,
                                                           **engine_options))
        ps = [params[i] if extra is None else SamplingParams(max_tokens=NEW_TOKENS, seed=i, **extra) for i in rows]
        outs = [o.token_ids for o in eng.generate([prompts[i] for i in rows], ps)]
        assert eng.all_blocks_free()
        return outs, eng.pipeline and eng.pipeline.adopted

    static = [i for i in range(len(refs)) if i % 4 in (0, 1)] + [len(refs)]  # biases, allowed sets, a sampled one
    outs, adopted = run(static)
    assert adopted > 0 and outs == [target_only[i] for i in static]
    assert outs[:-1] == [refs[i] for i in static[:-1]]
    plain = run(static, {}, {}, None)[0]
    for extra in (dict(presence_penalty=1.5, frequency_penalty=0.5), dict(repetition_penalty=1.5, temperature=0.8),
                  dict(min_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0)):
        outs, adopted = run(static, extra)
        expected = run(static, extra, {}, None)[0]  # (target-only, packed steps: nothing queued)
        assert adopted > 0 and outs == expected, extra
        assert extra.get("min_tokens") or expected != plain  # (the penalty changes the output)


def test_a_row_is_penalized_only_while_min_tokens_holds_it_back():
    """``Request.penalized`` (the fast paths skip such rows): a min_tokens row until its output has that many
    tokens, a row with a bias or an allowed set always; ``plain_greedy`` is its complement for greedy rows."""
    held = Request("a", [1, 2], SamplingParams(min_tokens=3, max_tokens=8), (EOS,))
    seen = []
    for t in (5, 6, 7, 8):
        seen.append((held.penalized, held.plain_greedy))
        held.tokens.append(t)
    assert seen == [(True, False)] * 3 + [(False, True)]
    for extra in (dict(logit_bias={4: 1.0}), dict(allowed_token_ids=[4, 5])):
        req = Request("b", [1, 2], SamplingParams(**extra), (EOS,))
        req.tokens += [5] * 10
        assert req.penalized and not req.plain_greedy
    assert not Request("c", [1, 2], SamplingParams(), (EOS,)).penalized


def test_held_back_tokens_follow_each_verify_tokens_depth():
    """``ContextPenalty.apply``: a row with one output token and min_tokens 3 holds its EOS and stop id back at
    the root and depth 1 (its outputs 1 and 2), not at depth 2 (output 3); the bias is added at every depth, and
    the allowed set leaves -inf elsewhere."""
    req = Request("a", [1, 2], SamplingParams(min_tokens=3, stop_token_ids=[7], logit_bias={4: 2.0}), (2,))
    req.tokens.append(9)
    masks = torch.tensor([[0b1, 0b11, 0b111, 0b1001]])  # root, depth 1, depth 2, depth 1 (another branch)
    assert path_depth(masks).tolist() == [[0, 1, 2, 1]]
    x = ContextPenalty.of([req], [0], 1, 12, "cpu").apply(torch.zeros(1, 4, 12), torch.zeros(1, 4, dtype=torch.long),
                                                          masks)[0]
    held = torch.isinf(x[:, [2, 7]]).all(-1).tolist()
    assert held == [True, True, False, True]
    assert (x[:, 4] == 2.0).all() and not torch.isinf(x[:, [0, 1, 3, 5, 6, 8]]).any()
    allowed = Request("b", [1], SamplingParams(allowed_token_ids=[3, 5]), (2,))
    y = ContextPenalty.of([allowed], [0], 1, 8, "cpu").apply(torch.zeros(1, 1, 8), torch.zeros(1, 1, dtype=torch.long),
                                                             torch.tensor([[1]]))[0, 0]
    assert torch.isinf(y).tolist() == [True, True, True, False, True, False, True, True]


def test_bad_words_pad_to_a_power_of_two_and_ban_the_same_tokens():
    """``BadWords`` of words of up to 4 and up to 5 tokens, three and four words a row, share a layout (padded to
    powers of two: one graph of the sampled rule serves both); padding bans nothing: at a root whose output ends with
    a word's leading tokens exactly that word's last token is banned."""
    def req(words, output):
        r = Request("a", [1], SamplingParams(max_tokens=8), (2,))
        r.tokens += output
        r.bad_word_ids = words
        return r

    short = ContextPenalty.of([req(((3, 4, 5, 6), (9,), (4, 10)), [3, 4, 5])], [0], 1, 12, "cpu")
    long = ContextPenalty.of([req(((1, 6, 7, 8, 11), (9,), (4, 10), (8, 3)), [1, 6, 7, 8])], [0], 1, 12, "cpu")
    assert short.layout == long.layout and short.bad.words.shape == (1, 4, 5)
    root, mask = torch.zeros(1, 1, dtype=torch.long), torch.tensor([[1]])
    for penalty, banned in ((short, {6, 9}), (long, {11, 9, 3})):
        x = penalty.apply(torch.zeros(1, 1, 12), root, mask)[0, 0]
        assert set(torch.nonzero(torch.isinf(x)).flatten().tolist()) == banned


def test_stop_strings_wait_for_min_tokens(letter_target):
    """A stop string the greedy output holds early ends it there without min_tokens, and only after min_tokens
    tokens with it (the text then cut at its first occurrence past them)."""
    eng = SpecEngine(None, letter_target, SpecConfig(num_blocks=128, block_size=4))
    free = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop = free.text[2:4]  # text of tokens near the start
    early = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True, stop=stop))[0]
    late = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True, stop=stop, min_tokens=8))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 8
    assert len(late.token_ids) >= 8 and late.token_ids == free.token_ids[:len(late.token_ids)]
    # the first occurrence that ends past the text of the first 7 tokens (one ending with the 8th counts)
    head = letter_target.tokenizer.decode(free.token_ids[:7])
    at = free.text.find(stop, len(head) - len(stop) + 1)
    assert (late.finish_reason, late.text) == (("stop", free.text[:at]) if at >= 0 else ("length", free.text))


@pytest.mark.parametrize("fields,match", [
    (dict(logit_bias={5: 101}), "logit_bias must be None or a dict"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias=[3, 4]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be None or a non-empty"),
    (dict(min_tokens=9, max_tokens=8), r"min_tokens must be an int >= 0 and <= max_new_tokens \(8\)"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(bad_words=["fine", "\ud800"]), "bad_words must be .* of valid Unicode"),
    (dict(bad_words=[""]), "bad_words"),
])
def test_bad_values_name_the_field(fields, match):
    with pytest.raises(FieldError, match=match):
        SamplingParams(**fields)


def test_the_engine_checks_ids_against_the_vocabulary(tiny_target):
    """Ids past the vocabulary, or an allowed set min_tokens leaves nothing of, are refused when queued; nothing is
    left queued."""
    eng = SpecEngine(None, tiny_target, SpecConfig(num_blocks=64, block_size=4))
    for params, field in ((SamplingParams(logit_bias={TINY_VOCAB: 1.0}), "logit_bias"),
                          (SamplingParams(allowed_token_ids=[3, TINY_VOCAB + 4]), "allowed_token_ids"),
                          (SamplingParams(allowed_token_ids=[EOS, 9], stop_token_ids=[9], min_tokens=2), "min_tokens")):
        with pytest.raises(FieldError, match=field):
            eng.add_request(PROMPTS[0], params)
    assert not eng.scheduler.waiting and not eng.scheduler.running
    ok = eng.generate([PROMPTS[0]], SamplingParams(allowed_token_ids=[EOS, 9], min_tokens=2, max_tokens=4,
                                                   ignore_eos=True))[0]
    assert set(ok.token_ids) <= {EOS, 9} and len(ok.token_ids) == 4


def test_the_server_takes_openai_and_vllm_fields():
    """``logit_bias`` with OpenAI's string keys, ``min_tokens``, ``allowed_token_ids`` and ``bad_words`` reach
    SamplingParams; a
    key that is no token id, or a bias out of range, is a 400 naming logit_bias."""
    body = {"prompt": "hi", "logit_bias": {"50": -100, "7": 2.5}, "min_tokens": 3, "allowed_token_ids": [7, 50, 9],
            "bad_words": ["no", "never"]}
    params = parse_completion(body, "m").params
    assert params.logit_bias == ((7, 2.5), (50, -100.0)) and params.min_tokens == 3
    assert params.bad_words == ("no", "never")
    assert params.allowed_token_ids == (7, 9, 50)
    for bias in ({"x7": 1}, {"-3": 1}, {"7": 300}, [1, 2]):
        with pytest.raises(BadRequest) as err:
            parse_completion({"prompt": "hi", "logit_bias": bias}, "m")
        assert err.value.field == "logit_bias"
    with pytest.raises(BadRequest) as err:  # (JSON's "\ud800" escape: a lone surrogate no tokenizer takes)
        parse_completion(json.loads('{"prompt": "hi", "bad_words": ["\\ud800"]}'), "m")
    assert err.value.field == "bad_words"


@pytest.fixture(scope="module")
def spaced_target(tiny_target):
    """The tiny target with a word-level tokenizer that splits text at spaces: token i is "t<i>", so "t5 t9" is
    the two tokens 5 and 9 (bad words of several tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specdec.loading.registry import LoadedModel

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(TINY_VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.Fuse()
    return LoadedModel("tiny-spaced", tiny_target.model, PreTrainedTokenizerFast(tokenizer_object=tok),
                       tiny_target.config)


def _reference_bad(model, prompt: list[int], seqs: list[tuple[int, ...]]) -> list[int]:
    """Greedy decoding with bad words: the last token of each sequence is -inf wherever the output so far ends
    with the rest of it."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()  # (V,)
            out = tokens[len(prompt):]
            for seq in seqs:
                if len(out) >= len(seq) - 1 and tuple(out[len(out) - len(seq) + 1:]) == seq[:-1]:
                    logits[seq[-1]] = -torch.inf
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("name,options", CONFIGS[::2], ids=[f"{n}-{'-'.join(o) or 'packed'}" for n, o in CONFIGS[::2]])
def test_bad_words_equal_the_reference(tiny_dirs, spaced_target, tiny_draft, tiny_eagle, name, options):  # noqa: F811
    """Bad words of one and of two tokens taken from each prompt's plain output: greedy rows equal the reference
    loop (so the pair's second token never follows its first, the single token never comes), with every proposer;
    a seeded sampled row equals target-only decoding's tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dirs["llama"]), dtype=torch.float32).eval()
    fixed = dict(max_tokens=NEW_TOKENS, ignore_eos=True)
    plain = [_reference_bad(hf, p, []) for p in PROMPTS]
    words = [[f"t{out[2]} t{out[3]}", f"t{out[6]}"] for out in plain]
    seqs = [bad_word_ids(w, spaced_target.tokenizer) for w in words]
    assert seqs[0] == ((plain[0][2], plain[0][3]), (plain[0][6],))
    refs = [_reference_bad(hf, p, list(s)) for p, s in zip(PROMPTS, seqs)]
    assert all(r != o for r, o in zip(refs, plain))
    params = [SamplingParams(bad_words=w, **fixed) for w in words]
    params.append(SamplingParams(temperature=0.9, seed=3, bad_words=words[0], **fixed))
    prompts = [*PROMPTS, PROMPTS[0]]
    alone = SpecEngine(None, spaced_target, SpecConfig(num_blocks=256, block_size=4))
    want = [o.token_ids for o in alone.generate(prompts, params)]
    draft = {"none": None, "ngram": "ngram", "model": tiny_draft, "eagle": tiny_eagle}[name]
    tree = "chain:3" if name in ("none", "ngram") else "topk:2x2"
    eng = SpecEngine(draft, spaced_target, SpecConfig(tree=tree, num_blocks=256, block_size=4, adaptive=False,
                                                      **options))
    outs = [o.token_ids for o in eng.generate(prompts, params)]
    assert outs[:len(refs)] == refs and outs == want
    assert eng.all_blocks_free()


def test_bad_words_need_a_tokenizer(tiny_target):
    eng = SpecEngine(None, tiny_target, SpecConfig(num_blocks=64, block_size=4))
    with pytest.raises(FieldError, match=r"bad_words needs a model with a tokenizer.*logit_bias=\{id: -100\}"):
        eng.add_request(PROMPTS[0], SamplingParams(bad_words=["x"]))
