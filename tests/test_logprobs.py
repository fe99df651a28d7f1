"""Log-probabilities of the output tokens (``SamplingParams.logprobs``, vLLM's): with every proposer and step kind,
each output token's log-probability, rank and top-k equal a reference computed from the full model's raw logits
over the prompt and the output; the tokens are those of the same requests without logprobs; stop rules cut the
log-probabilities with the tokens; streaming hands each token's once; bad values are refused with the field
named; the server answers OpenAI's shapes (chat ``logprobs``/``top_logprobs``, completion ``logprobs``)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from test_repetition_penalty import CONFIGS, PROMPTS
from test_spec_sampling import tiny_eagle  # noqa: F401 (the fixture)

from specdec.engine import SpecConfig, SpecEngine
from specdec.errors import FieldError
from specdec.outputs import Logprob
from specdec.sampling_params import MAX_LOGPROBS, SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

NEW_TOKENS = 12
TOL = 2e-4  # float32: the engine's log-softmax over a verify's logits against one over a full forward's


@pytest.fixture(scope="module")
def hf(tiny_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_dirs["llama"]), dtype=torch.float32).eval()


def _reference(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """(len(output), V) raw log-probabilities of the full model at each output token's position."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()  # (P + O, V)
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(output)], -1)


def _check(hf, prompt: list[int], out, k: int) -> None:
    """``out``'s log-probabilities: one dict per token, its chosen token with the reference's log-probability and
    rank, then the reference's top k (as a set: ties may order them either way), and the cumulative sum."""
    ref = _reference(hf, prompt, out.token_ids)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        first = next(iter(entry))
        assert first == tok
        lp = entry[tok]
        assert isinstance(lp, Logprob) and abs(lp.logprob - ref[j, tok].item()) < TOL
        assert lp.rank == int((ref[j] > ref[j, tok] + TOL).sum()) + 1 or abs(
            ref[j].sort(descending=True).values[lp.rank - 1] - ref[j, tok]) < TOL
        total += lp.logprob
        top = ref[j].topk(k)
        others = {t: v for t, v in entry.items() if t != tok or tok in top.indices.tolist()}
        assert len(others) == k
        for t, v in others.items():
            assert abs(v.logprob - ref[j, t].item()) < TOL and v.rank <= k
        assert min(v.logprob for v in others.values()) >= top.values[-1].item() - TOL if k else True
    assert abs(out.outputs[0].cumulative_logprob - total) < 1e-6 * max(1.0, abs(total))
    assert out.outputs[0].logprobs is out.logprobs


@pytest.mark.parametrize("name,options", CONFIGS, ids=[f"{n}-{'-'.join(o) or 'packed'}" for n, o in CONFIGS])
def test_logprobs_equal_the_full_models(tiny_target, tiny_draft, tiny_eagle, hf, name, options,  # noqa: F811
                                        caplog):
    """Every proposer and step kind (float32): greedy rows (top 3), seeded sampled rows (the chosen token's alone,
    and top 5) and rows without logprobs in one batch; the tokens equal the same requests' without logprobs, and no
    batch raised (fault isolation, which would retry its rows one by one, warned of none)."""
    draft = {"none": None, "ngram": "ngram", "model": tiny_draft, "eagle": tiny_eagle}[name]
    tree = "chain:3" if name in ("none", "ngram") else "topk:2x2"
    eng = SpecEngine(draft, tiny_target, SpecConfig(tree=tree, num_blocks=256, block_size=4, adaptive=False,
                                                    **options))
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    hot = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.9, seed=4, logprobs=0),
           SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0, top_p=0.8, seed=9, logprobs=5)]
    prompts = [*PROMPTS, PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    params = [greedy] * len(PROMPTS) + hot + [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)]
    with caplog.at_level(logging.WARNING, logger="specdec.fault_isolation"):
        outs = eng.generate(prompts, params)
    assert not caplog.records
    for prompt, p, out in zip(prompts, params, outs):
        if p.logprobs is None:
            assert out.logprobs is None and out.outputs[0].cumulative_logprob is None
        else:
            _check(hf, prompt, out, p.logprobs)
    plain = eng.generate(prompts, [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=p.temperature,
                                                  top_p=p.top_p, seed=p.seed) for p in params])
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert eng.all_blocks_free()


def test_logprobs_stop_with_the_tokens_and_stream_once(tiny_target, hf):
    """EOS inside an accepted chain and max_tokens cut the log-probabilities with the tokens; streamed outputs
    hand each token's log-probabilities once (``new_logprobs``), in order, ending with the whole list."""
    eng = SpecEngine("ngram", tiny_target, SpecConfig(tree="chain:4", num_blocks=256, block_size=4, adaptive=False))
    free = eng.generate([PROMPTS[1]], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0].token_ids
    stop_at = free[5]
    params = SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=[stop_at], logprobs=2)
    out = eng.generate([PROMPTS[1]], params)[0]
    assert out.token_ids == free[:free.index(stop_at) + 1] and out.finish_reason == "stop"
    _check(hf, PROMPTS[1], out, 2)
    short = eng.generate([PROMPTS[1]], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=1))[0]
    assert len(short.token_ids) == len(short.logprobs) == 3
    seen, last = [], None
    for last in eng.stream([PROMPTS[1]], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)):
        assert len(last.new_logprobs) == len(last.new_token_ids)
        seen += last.new_logprobs
    assert seen == last.logprobs and len(seen) == NEW_TOKENS
    assert math.isclose(last.cumulative_logprob, sum(e[t].logprob for e, t in zip(seen, last.token_ids)),
                        rel_tol=1e-9)


def test_token_text_and_samples(letter_target):
    """Each entry names its token's text; n samples each carry their own."""
    eng = SpecEngine(None, letter_target, SpecConfig(num_blocks=128, block_size=4))
    out = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2, n=2,
                                                    temperature=1.0, seed=1))[0]
    tok = letter_target.tokenizer
    for sample in out.outputs:
        assert len(sample.logprobs) == 6
        for entry in sample.logprobs:
            assert all(v.decoded_token == tok.decode([t]) for t, v in entry.items())
    assert out.outputs[0].token_ids != out.outputs[1].token_ids


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 2.0, True, "3"])
def test_bad_logprobs_name_the_field(value):
    with pytest.raises(FieldError, match="logprobs must be None or an int >= 0 and <= 20"):
        SamplingParams(logprobs=value)


@pytest.mark.parametrize("name", ["none", "ngram", "eagle"])
def test_rows_with_logprobs_keep_their_steps_pipelined(tiny_target, tiny_eagle, hf, name):  # noqa: F811
    """A pipelined engine queues the next step behind the verify of rows asking for log-probabilities (their
    logits are copied out of the verify's output first, ``logprobs.keep_logits``): it adopts as many queued steps
    as for the same rows without them, and the values equal the full model's."""
    draft = {"none": None, "ngram": "ngram", "eagle": tiny_eagle}[name]
    tree = "chain:3" if name != "eagle" else "topk:2x2"

    def run(logprobs):
        options = dict(cuda_graphs=True, pipeline=True, ngram_device=name == "ngram")
        eng = SpecEngine(draft, tiny_target, SpecConfig(tree=tree, num_blocks=256, block_size=4, adaptive=False,
                                                        **options))
        outs = eng.generate(list(PROMPTS), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs))
        return outs, eng.pipeline.adopted

    (outs, adopted), (plain, adopted_plain) = run(2), run(None)
    assert adopted == adopted_plain > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for prompt, out in zip(PROMPTS, outs):
        _check(hf, prompt, out, 2)


def test_cli_prints_each_tokens_logprobs(tiny_dirs, tmp_path, capsys):
    """``specdec generate --logprobs K``: one stderr line per output token with the engine's log-probability and
    K most probable tokens, then the sum; a K out of range is a usage error naming the flag."""
    from serving_helpers import with_tokenizer

    from specdec.cli import main

    model = with_tokenizer(tiny_dirs["llama"], tmp_path / "llama")
    args = ["generate", "--model", str(model), "--draft", "ngram", "--device", "cpu", "--prompt", "abc",
            "--max-new-tokens", "5", "--ignore-eos"]
    assert main(args + ["--logprobs", "2"]) == 0
    err = capsys.readouterr().err.splitlines()
    rows = [line.split() for line in err if line[:4].strip().isdigit()]
    assert [int(r[0]) for r in rows] == list(range(5))
    eng = SpecEngine("ngram", str(model), SpecConfig(num_blocks=64, device="cpu"))  # (the CLI's device)
    want = eng.generate(["abc"], SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2))[0]
    for line, tok, entry in zip([line for line in err if line[:4].strip().isdigit()], want.token_ids,
                                want.logprobs):
        assert f"{entry[tok].logprob:.4f}" in line and line.count(" -") >= 3  # its own, then two most probable
    assert err[-1] == f"[cumulative logprob {want.outputs[0].cumulative_logprob:.4f}]"
    assert main(args + ["--logprobs", "21"]) == 2
    assert "--logprobs" in capsys.readouterr().err


@pytest.mark.parametrize("options", [{}, dict(max_num_tokens=8), dict(cuda_graphs=True, pipeline=True)],
                         ids=["whole", "chunked", "pipelined"])
def test_prompt_logprobs_equal_the_full_models(tiny_target, tiny_draft, hf, options, caplog):
    """``prompt_logprobs`` (vLLM's): entry 0 is None, entry p the full model's log-probability and rank of prompt
    token p and its top k, whether the prompt is prefilled whole or in chunks of 8 tokens, batched with plain
    requests; a request after the same prompt was cached still gets every entry (no prefix hit serves it), and a
    plain request after it still hits the cache."""
    eng = SpecEngine(tiny_draft, tiny_target, SpecConfig(tree="chain:3", num_blocks=256, block_size=4, adaptive=False,
                                                         **options))
    asking = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=4, ignore_eos=True)
    for _ in range(2):  # (the second time the prompts are cached)
        with caplog.at_level(logging.WARNING, logger="specdec.fault_isolation"):
            outs = eng.generate(list(PROMPTS), [asking, plain] + [asking] * (len(PROMPTS) - 2))
        assert not caplog.records
        for prompt, out in zip(PROMPTS, outs):
            if out.prompt_logprobs is None:
                continue
            assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
            ref = _reference(hf, prompt[:1], prompt[1:])  # (P - 1, V): position p - 1 gives token p
            for p in range(1, len(prompt)):
                entry = out.prompt_logprobs[p]
                assert next(iter(entry)) == prompt[p]
                assert abs(entry[prompt[p]].logprob - ref[p - 1, prompt[p]].item()) < TOL
                top = set(ref[p - 1].topk(2).indices.tolist())
                assert set(entry) - {prompt[p]} <= top and len(set(entry) | top) <= 3
        assert outs[1].prompt_logprobs is None and outs[0].logprobs is None
    cache = eng.scheduler.prefix_cache
    before = cache.stats.hit_tokens
    eng.generate([PROMPTS[2]], plain)
    assert cache.stats.hit_tokens > before  # (the prompt_logprobs requests computed and cached it)
    assert eng.all_blocks_free()


def test_ranked_in_slices_equals_one_pass(monkeypatch):
    """``logprobs.ranked`` over slices of rows (a long prompt's chunk) gives what one pass gives: each chosen
    token's log-softmax value and rank (1 + the tokens strictly more probable), then the top k."""
    from specdec import logprobs

    x = torch.randn(10, 50, generator=torch.Generator().manual_seed(0))
    chosen, ks = [int(t) for t in torch.randint(0, 50, (10,), generator=torch.Generator().manual_seed(1))], [3] * 10
    whole = logprobs.ranked(x, chosen, ks)
    monkeypatch.setattr(logprobs, "SLICE_ROWS", 3)
    assert logprobs.ranked(x, chosen, ks) == whole
    lp = torch.log_softmax(x, -1)
    for j, entry in enumerate(whole):
        value, rank = entry[chosen[j]]
        assert value == pytest.approx(lp[j, chosen[j]].item(), abs=1e-6)
        assert rank == int((lp[j] > lp[j, chosen[j]]).sum()) + 1
        assert set(entry) - {chosen[j]} <= set(lp[j].topk(3).indices.tolist())


def test_kept_logits_are_read_in_one_gather(monkeypatch):
    """``keep_logits`` copies the asking rows' padded blocks out of a verify's (B * q, V) output (row i of the rows
    at its row ``sel[i]`` of an adopted step), and ``with_logprobs`` reads every asking row's queries from that copy
    in one gather (one index upload for it, one for the chosen tokens), whatever number of rows ask; each entry is
    the log-softmax of its own query's logits, and a row that does not ask gets none."""
    from types import SimpleNamespace

    from specdec import logprobs

    b, q, vocab = 4, 3, 20
    full = torch.randn(b * q, vocab, generator=torch.Generator().manual_seed(2))
    rows = [SimpleNamespace(params=SimpleNamespace(logprobs=k)) for k in (2, None, 1, 0)]
    sel = [3, 0, 1, 2]  # (adopted: row i of ``rows`` is the step's row sel[i])
    kept = logprobs.keep_logits(rows, full, q, sel)
    uploads = []
    real = logprobs._upload
    monkeypatch.setattr(logprobs, "_upload", lambda values, device: uploads.append(list(values)) or real(values,
                                                                                                           device))
    full.zero_()  # (the queued step's replay rewrites the output: the copy is read)
    result = SimpleNamespace(accepted_nodes=[1], accepted_tokens=[5], bonus_token=7, logprobs=None,
                             _replace=lambda **kw: kw)
    out = logprobs.with_logprobs(rows, kept, [result] * 4)
    assert len(uploads) == 2 and out[1] is result
    original = torch.randn(b * q, vocab, generator=torch.Generator().manual_seed(2)).view(b, q, vocab)
    for i in (0, 2, 3):
        lp = torch.log_softmax(original[sel[i]], -1)
        entries = out[i]["logprobs"]
        assert [next(iter(e)) for e in entries] == [5, 7]
        for e, query, tok in zip(entries, (0, 2), (5, 7)):  # (query 0, then accepted node 1's: query 2)
            assert e[tok][0] == pytest.approx(lp[query, tok].item(), abs=1e-6)
            assert len(e) <= 1 + rows[i].params.logprobs


def test_each_token_carries_its_own_bytes(smollm2, letter_target):
    """A byte-level tokenizer's tokens that hold part of a UTF-8 character read "\\ufffd" but carry their own bytes,
    which joined give the text back; a chat answer's ``bytes`` are them. A word-level tokenizer's are its texts'."""
    from specdec.scheduler.stop import StopChecker

    from specdec.outputs import Logprob
    from specdec.serving.protocol import logprobs_body

    tok = smollm2.tokenizer
    stop = StopChecker(tok)
    text = "café 😀 naïve"
    ids = tok.encode(text)
    pieces = [stop.logprob_entry({t: (-1.0, 1)})[t] for t in ids]
    assert b"".join(p.token_bytes for p in pieces).decode("utf-8") == text
    assert any("\ufffd" in p.decoded_token for p in pieces)  # (the emoji spans tokens)
    chat = logprobs_body([{t: p} for t, p in zip(ids, pieces)], 0, True)["content"]
    assert bytes(sum((c["bytes"] for c in chat), [])).decode("utf-8") == text
    letters = StopChecker(letter_target.tokenizer)
    assert letters.logprob_entry({30: (-1.0, 1)})[30] == Logprob(-1.0, 1, "be", b"be")
