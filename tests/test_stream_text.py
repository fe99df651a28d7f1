"""Incremental detokenisation: the streamed text grows by appending and ends equal to a full decode."""

from specdec.scheduler.request import Request
from specdec.scheduler.stop import StopChecker

from specdec.sampling_params import SamplingParams

TEXTS = ["Héllo wörld! 你好，世界。 Emoji: 😀👍🏽 and code: def f(x):\n    return x**2",
         "  leading spaces\tand tabs\n\nnew lines ☃☃ -- ‘quotes’ «guillemets»"]


def test_running_text_matches_full_decode_token_by_token(smollm2):
    tok = smollm2.tokenizer
    checker = StopChecker(tok)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        req = Request("r", [1], SamplingParams())
        seen = ""
        for i, t in enumerate(ids):
            req.tokens.append(t)
            cur = checker.running_text(req)
            assert cur.startswith(seen)  # streaming only ever appends
            assert tok.decode(ids[:i + 1], skip_special_tokens=True).startswith(cur)
            seen = cur
        assert seen == tok.decode(ids, skip_special_tokens=True)


def test_decode_matches_the_tokenizer(smollm2):
    """The checker may call the Rust tokenizer directly (SmolLM2's decode adds nothing to it); the
    text is the tokenizer's own, special tokens skipped."""
    import random

    tok = smollm2.tokenizer
    checker = StopChecker(tok)
    assert checker._backend is not None  # the fast path is the one under test
    rng = random.Random(0)
    for n in range(1, 40):
        ids = [rng.randrange(len(tok)) for _ in range(n)] + [0, 1, 2]
        assert checker.decode(ids) == tok.decode(ids, skip_special_tokens=True)


def test_extend_equals_appending_one_by_one():
    """``StopChecker.extend`` stops where appending token by token stops (EOS, stop tokens, length)."""
    import random

    checker = StopChecker(None)
    rng = random.Random(0)
    for _ in range(500):
        params = SamplingParams(max_new_tokens=rng.randrange(1, 8), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=rng.sample(range(6), rng.randrange(0, 2)))
        prompt = [9] * rng.randrange(1, 4)
        done = rng.randrange(0, params.max_new_tokens)
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 6))]
        one, many = (Request("r", prompt, params, eos_token_ids=(5,)) for _ in range(2))
        for req in (one, many):
            req.tokens += [7] * done
        reason, n = None, 0
        for tok in tokens:
            reason, n = checker.append(one, tok), n + 1
            if reason:
                break
        assert checker.extend(many, tokens) == (reason, n)
        assert many.tokens == one.tokens


def _stop_reference(tok, prompt: list[int], ids: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Where appending ``ids`` one by one first stops on a stop string, by a full decode after every token:
    (tokens appended, the text before the stop), or None."""
    for i in range(len(ids)):
        text = tok.decode(ids[:i + 1], skip_special_tokens=True)
        hits = [j for j in (text.find(s) for s in stops) if j >= 0]
        if hits:
            return i + 1, text[:min(hits)]
    return None


def test_stop_strings_are_found_as_a_full_decode_finds_them_in_time_linear_in_the_output(smollm2):
    """Stop strings (multi-byte characters split across tokens, a stop inside one token, stops spanning tokens)
    stop at the token and with the text a full decode after every token gives; the tokens decoded per appended
    token stay bounded instead of growing with the output."""
    import random

    tok = smollm2.tokenizer
    checker = StopChecker(tok)
    decoded = []
    backend_decode = checker._backend.decode
    checker._backend = type("Counting", (), {"decode": lambda self, ids, **kw: decoded.append(len(ids)) or
                                             backend_decode(ids, **kw)})()
    rng = random.Random(1)
    body = " ".join(TEXTS) * 3
    cases = [("😀👍", "世界"), ("return x", "ö"), ("wörld!",), ("«gui",), ("never there",), ("\n\n", "  lead")]
    for stops in cases:
        for _ in range(3):
            start = rng.randrange(len(body) // 2)
            ids = tok.encode(body[start:], add_special_tokens=False)
            req = Request("r", [1], SamplingParams(stop=list(stops), max_new_tokens=10_000))
            decoded.clear()
            got = None
            for i, t in enumerate(ids):
                if checker.append(req, t) == "stop":
                    got = (i + 1, req.text)
                    break
            assert got == _stop_reference(tok, [1], ids, stops), (stops, start)
            n = got[0] if got else len(ids)
            assert sum(decoded) <= 12 * n  # a full decode per token would be ~n * n / 2
