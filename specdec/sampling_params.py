"""Per-request sampling parameters."""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from specdec.errors import FieldError

DEFAULT_MAX_NEW_TOKENS = 64
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts [0, 2**64)
# a temperature below this samples as greedy (it is stored as 0): float32 logits divided by a smaller one can
# overflow to infinity, and the distribution it asks for is the argmax up to float32 rounding anyway
GREEDY_TEMPERATURE_FLOOR = 1e-5
# the largest temperature: float32's largest finite number (the engine divides float32 logits by the temperature, and a
# larger one rounds to infinity there)
MAX_TEMPERATURE = 3.4028234663852886e38
# a top_p below this is stored as it: float32 rounds 1e-300 to 0, which drops every token, and any top_p below the
# largest probability (>= 1 / vocab) keeps just the most probable token anyway
TOP_P_FLOOR = 1e-30
# repetition_penalty bounds: logits divided or multiplied by a penalty outside them overflow float32
REPETITION_PENALTY_RANGE = (1e-30, 1e30)
COUNT_PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty (OpenAI's and vLLM's range)
MAX_N = 128  # samples of one prompt (OpenAI's limit): each is a request of its own
# stop strings: every step checks each against the output on the engine's thread
MAX_STOPS, MAX_STOP_CHARS = 128, 4096  # strings, characters in all
MAX_STOP_TOKEN_IDS = 4096  # stop_token_ids per request (every committed token is looked up in them)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token in effect, 100 makes it all but certain
MAX_LOGIT_BIAS = 4096  # logit_bias entries per request (scattered into a dense bias row at every step)
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # allowed_token_ids per request: a vocabulary's worth
MAX_BAD_WORDS = 128  # bad_words per request, of at most MAX_STOP_CHARS characters in all (as stop strings)
MAX_LOGPROBS = 20  # top log-probabilities per output token (vLLM's default max_logprobs, OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. Validated (types included) at construction.

    temperature 0 means greedy; a temperature below ``GREEDY_TEMPERATURE_FLOOR`` is stored as 0 (greedy), so
    every proposer and the server decode it the same way; a top_p below ``TOP_P_FLOOR`` is stored as it (the same
    kept token). top_k 0 (or -1, as in vLLM; stored as 0) and top_p 1.0
    disable those filters. ``stop`` is one string or a sequence of strings (needs a model with a tokenizer);
    ``stop_token_ids`` a sequence of token ids; None (vLLM's default) is none for both. Integers of any integral
    type (numpy included) are stored as int.
    ``max_tokens`` is vLLM's name of ``max_new_tokens``: give either (``params.max_tokens`` reads it back); None, as
    in vLLM, generates until a stop or the model's context is full (or the KV pool, if it holds less; the engine sets
    the number as the request is queued). ``fit_max_new_tokens`` makes ``max_new_tokens`` a ceiling rather than a
    demand: a prompt that leaves less room (the context after the prompt and the draft's lookahead, or the KV pool)
    gets that room instead of a refusal (a server's default for a request that set no max_tokens, as vLLM's).
    ``min_p`` (0 = off) drops, after temperature, top-k and top-p, the tokens whose probability is below min_p
    times the most probable token's. ``repetition_penalty`` (1 = off) divides the positive raw logits (and
    multiplies the negative ones) of every token in the prompt or the output so far, before temperature; greedy
    rows take the argmax of the penalized logits. ``presence_penalty`` and ``frequency_penalty`` (OpenAI's and
    vLLM's, in [-2, 2], 0 = off) then subtract ``frequency_penalty * count + presence_penalty * (count > 0)`` from
    each token's raw logit, count being its occurrences in the output so far (the prompt is not counted). ``n``
    samples of the prompt are returned as the ``outputs`` of one ``RequestOutput``; with a seed, sample i draws
    from ``sample_seed(seed, i)``.
    ``logit_bias`` ({token id: bias in [-100, 100]}, OpenAI's) adds each bias to its token's raw logit, and
    ``allowed_token_ids`` (vLLM's; None = all) keeps only those tokens, both before the penalties, as in vLLM; each is
    stored as a tuple (of sorted (id, bias) pairs, and of ids), so the params stay hashable. ``min_tokens`` (vLLM's)
    holds back the tokens that end a request (its EOS unless ``ignore_eos``, and ``stop_token_ids``) until the output
    has that many tokens, and stop strings do not end it before then. ``bad_words`` (vLLM's; needs a tokenizer)
    are strings the output must not hold: each is tokenised as it is and with a leading space, and the last token of
    such a sequence is banned wherever the output ends with the rest of it (a one-token word everywhere). Token ids
    are checked against the model's vocabulary when the request is queued.
    ``logprobs`` (vLLM's; None = off) returns, for every output token, its log-probability under the target's raw
    distribution (its logits before temperature, filters and processors: vLLM's default ``raw_logprobs``) with its
    rank, and the ``logprobs`` most probable tokens' (0: the chosen token's alone; at most ``MAX_LOGPROBS``).
    ``prompt_logprobs`` (vLLM's) does the same for each prompt token after the first (the first's entry is None); such
    a request computes its whole prompt (no prefix-cache hit serves it). ``include_stop_str_in_output`` (vLLM's) keeps
    the stop string that ended the output at its end (by default the text is cut before it).
    ``truncate_prompt_tokens`` (vLLM's; None = off) keeps only the prompt's last k tokens (-1: as many as leave room
    for one output token). ``skip_special_tokens`` (vLLM's, True by default) leaves special tokens out of the output
    text; False spells them out (stop strings are then searched in that text).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    fit_max_new_tokens: bool = False
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "temperature", _real(self.temperature, "temperature", "must be a finite number >= 0 (0 = greedy) "
                                        "and <= 3.4e38 (float32's largest)", lambda t: 0 <= t <= MAX_TEMPERATURE))
        if self.temperature < GREEDY_TEMPERATURE_FLOOR:
            set_(self, "temperature", 0.0)
        set_(self, "top_p", max(TOP_P_FLOOR, _real(self.top_p, "top_p", "must be a number in (0, 1]",
                                                   lambda p: 0 < p <= 1)))
        set_(self, "top_k", max(0, _integer(self.top_k, "top_k", "must be an int >= -1 (0 or -1 = off)", -1, None)))
        if self.max_new_tokens is not None:
            set_(self, "max_new_tokens", _integer(self.max_new_tokens, "max_new_tokens",
                                                  "must be an int >= 1 or None (until the model's context is full)",
                                                  1, None))
        if self.seed is not None:
            set_(self, "seed", _integer(self.seed, "seed", "must be None or an int >= 0 and < 2**64", 0,
                                        MAX_SEED))
        set_(self, "stop", _strings(self.stop, "stop", MAX_STOPS))
        set_(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        set_(self, "_stop_id_set", frozenset(self.stop_token_ids))  # (not a field: equality and repr ignore it)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, "must be a bool", getattr(self, name))
        if self.truncate_prompt_tokens is not None:
            set_(self, "truncate_prompt_tokens", _integer(
                self.truncate_prompt_tokens, "truncate_prompt_tokens", "must be None, an int >= 1 (keep the prompt's "
                "last k tokens) or -1 (as many as leave room for output)", -1, None))
            _check(self.truncate_prompt_tokens != 0, "truncate_prompt_tokens", "must be None, an int >= 1 or -1",
                   self.truncate_prompt_tokens)
        _check(isinstance(self.fit_max_new_tokens, bool), "fit_max_new_tokens", "must be a bool",
               self.fit_max_new_tokens)
        set_(self, "min_p", _real(self.min_p, "min_p", "must be a number in [0, 1] (0 = off)", lambda p: 0 <= p <= 1))
        lo, hi = REPETITION_PENALTY_RANGE
        rule = f"must be a number > 0 (1 = off) in [{lo:g}, {hi:g}]"
        set_(self, "repetition_penalty", _real(self.repetition_penalty, "repetition_penalty", rule,
                                               lambda r: lo <= r <= hi))
        lo, hi = COUNT_PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            set_(self, name, _real(getattr(self, name), name, f"must be a number in [{lo:g}, {hi:g}] (0 = off)",
                                   lambda v: lo <= v <= hi))
        set_(self, "n", _integer(self.n, "n", f"must be an int >= 1 and <= {MAX_N}", 1, MAX_N))
        most = self.max_new_tokens if self.max_new_tokens is not None else None
        set_(self, "min_tokens", _integer(self.min_tokens, "min_tokens", "must be an int >= 0" + (
            f" and <= max_new_tokens ({most})" if most is not None else ""), 0, most))
        set_(self, "logit_bias", _logit_bias(self.logit_bias))
        set_(self, "allowed_token_ids", _allowed_ids(self.allowed_token_ids))
        set_(self, "bad_words", _strings(self.bad_words, "bad_words", MAX_BAD_WORDS))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                set_(self, name, _integer(getattr(self, name), name, f"must be None or an int >= 0 and <= "
                                          f"{MAX_LOGPROBS} (the most probable tokens returned beside the chosen one)",
                                          0, MAX_LOGPROBS))
        # (not fields: read for every row at every step, ``Request.penalized`` and ``Request.reads_context``)
        set_(self, "_contextual", self.repetition_penalty != 1.0 or self.presence_penalty != 0
             or self.frequency_penalty != 0 or bool(self.bad_words))
        set_(self, "_processed", self._contextual or bool(self.logit_bias) or self.allowed_token_ids is not None)

    @property
    def stop_id_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set: the stop check looks every committed token up in it."""
        return self._stop_id_set

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logits_processed(self) -> bool:
        """Every step's logits are changed: by a repetition, presence or frequency penalty (which depends on each
        verify token's context), ``logit_bias``, ``allowed_token_ids`` or ``bad_words``."""
        return self._processed

    @property
    def reads_context(self) -> bool:
        """Its logits change with the tokens before them (a repetition, presence or frequency penalty, or
        ``bad_words``); a bias or an allowed set alone changes them alike at every position."""
        return self._contextual

    @property
    def filtered(self) -> bool:
        """Some filter (top-k, top-p, min-p) drops tokens: the sampled rules need their sorting variant."""
        return (self.top_k or 0) > 0 or self.top_p < 1.0 or self.min_p > 0


def sample_seed(seed: int | None, i: int) -> int | None:
    """The seed of sample i of a request seeded with ``seed`` (``SamplingParams.n``): the seed itself for sample
    0, a hash of (seed, i) for the others; None (unseeded) stays None."""
    if seed is None or i == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def sample_requests(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The (request id, params) of each request that serves ``params.n`` samples of one prompt: the request
    itself when n is 1, else n requests ``{request_id}.{i}`` with n = 1 and sample i's seed (``sample_seed``)."""
    if params.n == 1:
        return [(request_id, params)]
    return [(f"{request_id}.{i}", replace(params, n=1, seed=sample_seed(params.seed, i))) for i in range(params.n)]


_UNSET = object()  # max_tokens not given (None is a value: vLLM's "until the context is full")


# vLLM SamplingParams fields specdec lacks -> what to do instead (the TypeError an unknown field raises says it)
VLLM_LACKING = {
    "best_of": "there is no best-of or beam search (n samples are n independent requests)",
    "use_beam_search": "there is no beam search", "length_penalty": "there is no beam search",
    "spaces_between_special_tokens": "special tokens are spelled as the tokenizer decodes them",
    "logits_processors": "no logits processors besides the penalties, logit_bias, allowed_token_ids, bad_words, "
                         "min_tokens, top_k, top_p and min_p",
    "guided_decoding": "no structured (guided) output", "structured_outputs": "no structured (guided) output",
    "detokenize": "outputs always carry their text", "output_kind": "outputs always carry their text",
}


def _unknown_field_error(name: str) -> TypeError:
    """The TypeError of ``SamplingParams(name=...)`` for a name that is no field: what to do instead of a vLLM
    field specdec lacks, else the closest fields."""
    import difflib
    from dataclasses import fields

    if name in VLLM_LACKING:
        return TypeError(f"SamplingParams has no field {name!r} (vLLM's): {VLLM_LACKING[name]}")
    known = sorted({f.name for f in fields(SamplingParams) if f.init} | {"max_tokens"})
    close = difflib.get_close_matches(name, known, n=2, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else f"fields: {', '.join(known)}"
    return TypeError(f"SamplingParams has no field {name!r} ({hint})")


def _taking_max_tokens(init):
    """``SamplingParams(max_tokens=N)``: vLLM's name of ``max_new_tokens`` (not a field of its own, so
    ``dataclasses.replace`` and equality see one value); giving both names is an error. A name that is no field is
    a TypeError saying what to use instead (``_unknown_field_error``)."""
    from dataclasses import fields

    known = {f.name for f in fields(SamplingParams) if f.init}

    @functools.wraps(init)
    def __init__(self, *args, max_tokens=_UNSET, **kwargs):
        unknown = next((k for k in kwargs if k not in known), None)
        if unknown is not None:
            raise _unknown_field_error(unknown)
        if max_tokens is not _UNSET:  # (None too: vLLM's "until the context is full")
            _check("max_new_tokens" not in kwargs, "max_tokens",
                   "is vLLM's name of max_new_tokens: give one of the two, not both", max_tokens)
            if max_tokens is not None:
                _integer(max_tokens, "max_tokens", "must be an int >= 1 or None (vLLM's name of max_new_tokens)",
                         1, None)
            kwargs["max_new_tokens"] = max_tokens
        init(self, *args, **kwargs)

    return __init__


SamplingParams.__init__ = _taking_max_tokens(SamplingParams.__init__)
SamplingParams.max_tokens = property(lambda self: self.max_new_tokens, doc="vLLM's name of max_new_tokens")


def _check(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise FieldError("SamplingParams", name, rule, value)


def _real(value, name: str, rule: str, in_range) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(_as_float(value))
    _check(ok and in_range(value), name, rule, value)
    return float(value)


def _as_float(value: numbers.Real) -> float:
    """``float(value)``; inf for an int (or Fraction) past float64's range, which ``float`` refuses."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _integer(value, name: str, rule: str, lo: int, hi: int | None) -> int:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    _check(ok and lo <= value and (hi is None or value <= hi), name, rule, value)
    return int(value)


def _strings(values, name: str, most: int) -> tuple[str, ...]:
    """``stop`` or ``bad_words``: one non-empty string or a list/tuple of them, at most ``most`` strings of
    ``MAX_STOP_CHARS`` characters in all; None (vLLM's default) is none."""
    rule = (f"must be None, a non-empty string or a list/tuple of non-empty strings of valid Unicode (at most "
            f"{most} strings of at most {MAX_STOP_CHARS} characters in all)")
    if values is None:
        return ()
    if isinstance(values, str):
        values = (values,)
    _check(isinstance(values, (list, tuple)) and len(values) <= most, name, rule, values)
    _check(all(isinstance(s, str) and s for s in values), name, rule, values)
    _check(sum(map(len, values)) <= MAX_STOP_CHARS, name, rule, values)
    _check(all(_utf8(s) for s in values), name, rule, values)  # (a lone surrogate: no text holds it)
    return tuple(values)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _token_ids(ids) -> tuple[int, ...]:
    rule = f"must be None or a list/tuple of at most {MAX_STOP_TOKEN_IDS} ints >= 0"
    if ids is None:  # vLLM's default
        return ()
    _check(isinstance(ids, (list, tuple)) and len(ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", rule, ids)
    return tuple(_integer(t, "stop_token_ids", rule, 0, None) for t in ids)


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs, from a mapping (or such pairs); None is none."""
    lo, hi = LOGIT_BIAS_RANGE
    rule = (f"must be None or a dict of at most {MAX_LOGIT_BIAS} token ids (ints >= 0) to biases in "
            f"[{lo:g}, {hi:g}]")
    if bias is None:
        return ()
    if isinstance(bias, Mapping):
        bias = tuple(bias.items())
    _check(isinstance(bias, (list, tuple)) and len(bias) <= MAX_LOGIT_BIAS
           and all(isinstance(e, (list, tuple)) and len(e) == 2 for e in bias), "logit_bias", rule, bias)
    pairs = {_integer(t, "logit_bias", rule, 0, None): _real(b, "logit_bias", rule, lambda v: lo <= v <= hi)
             for t, b in bias}
    _check(len(pairs) == len(bias), "logit_bias", rule + " (each id once)", bias)
    return tuple(sorted(pairs.items()))


def _allowed_ids(ids) -> tuple[int, ...] | None:
    """``allowed_token_ids`` as a sorted tuple of distinct ids; None (every token) stays None."""
    rule = f"must be None or a non-empty list/tuple of at most {MAX_ALLOWED_TOKEN_IDS} ints >= 0"
    if ids is None:
        return None
    _check(isinstance(ids, (list, tuple)) and 0 < len(ids) <= MAX_ALLOWED_TOKEN_IDS, "allowed_token_ids", rule, ids)
    return tuple(sorted({_integer(t, "allowed_token_ids", rule, 0, None) for t in ids}))
