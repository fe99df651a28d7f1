"""Stop conditions checked at every committed token: EOS, stop tokens, stop strings, length."""

from __future__ import annotations

from specdec.scheduler.request import Request

from specdec.outputs import Logprob


class StopChecker:
    """Decides, token by token, whether a request ends; keeps the request's output text current."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._backend = _plain_backend(tokenizer)
        # decode([t]) by t, for skip_special_tokens True and False: a one-token context window is decoded once
        self._one_token: dict[bool, dict[int, str]] = {True: {}, False: {}}
        self._token_text: dict[int, tuple[str, bytes]] = {}  # a token's own text and bytes (log-probabilities')
        self._byte_level = _byte_level(tokenizer)  # its byte-level alphabet's decoding, for a GPT-2 style tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """``tokenizer.decode(ids, skip_special_tokens=...)``; "" without a tokenizer."""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token: int) -> str:
        """One token's own text (special tokens spelled out), as log-probabilities name tokens; "" without a
        tokenizer."""
        return self._token(token)[0]

    def _token(self, token: int) -> tuple[str, bytes]:
        """One token's own text and bytes: the bytes it stands for under a byte-level tokenizer (GPT-2's alphabet)
        or a byte-fallback one ("<0xE2>"), else its text's UTF-8."""
        got = self._token_text.get(token)
        if got is None:
            text = self.decode([token], skip_special_tokens=False)
            got = self._token_text[token] = (text, _token_bytes(self.tokenizer, token, text, self._byte_level))
        return got

    def add_logprobs(self, req: Request, entries: list[dict[int, tuple[float, int]]]) -> None:
        """Append committed tokens' log-probabilities (``VerifyResult.logprobs``, one dict per token, the chosen
        token first) to ``req.logprobs`` as vLLM's ``{token id: Logprob}``, and add the chosen ones to
        ``req.cumulative_logprob``."""
        for entry in entries:
            req.cumulative_logprob += next(iter(entry.values()))[0]
            req.logprobs.append(self.logprob_entry(entry))

    def logprob_entry(self, entry: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        """One token's ``{token: (log-probability, rank)}`` as vLLM's ``{token: Logprob}``, with each token's text."""
        return {t: Logprob(v, r, *self._token(t)) for t, (v, r) in entry.items()}

    def running_text(self, req: Request) -> str:
        """The output's text so far, decoded incrementally: each call decodes only the tokens added
        since the last one, with a few earlier tokens as context (so spaces and merges render as in a
        full decode). An incomplete UTF-8 character at the end waits for its next token."""
        return self._decode_new(req)[0]

    def _decode_new(self, req: Request) -> tuple[str, str]:
        """``running_text``, and the text of the trailing tokens it holds back because they end in an incomplete
        character ("" when none): together, what a full decode of the output gives."""
        if self.tokenizer is None:
            return "", ""
        st = req.detok  # [prefix_offset, read_offset, text], offsets into the output
        ids, base = req.tokens, len(req.prompt_ids)  # slices of tokens: no copy of the whole output
        num_output = len(ids) - base
        if st[1] == num_output:
            return st[2], ""
        decode = (self.tokenizer if self._backend is None else self._backend).decode  # ``self.decode``'s call
        start, read, skip = base + st[0], base + st[1], req.params.skip_special_tokens
        if read - start == 1:  # the previous call's one new token (target-only steps, rows that accepted nothing)
            one = self._one_token[skip]
            prefix_text = one.get(ids[start])
            if prefix_text is None:
                prefix_text = one[ids[start]] = decode(ids[start:read], skip_special_tokens=skip)
        else:
            prefix_text = decode(ids[start:read], skip_special_tokens=skip)
        new_text = decode(ids[start:], skip_special_tokens=skip)
        tail = new_text[len(prefix_text):]
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            st[2] += tail
            st[0], st[1] = st[1], num_output
            return st[2], ""
        return st[2], tail

    def append(self, req: Request, token: int) -> str | None:
        """Append one token; return a finish reason if the request must stop after it."""
        req.tokens.append(token)
        p = req.params
        if not p.ignore_eos and token in req.eos_token_ids:
            return "stop"
        if token in p.stop_id_set:
            return "stop"
        if p.stop:
            stable, tail = self._decode_new(req)  # a few tokens decoded, not the whole output (linear, not square)
            text = stable + tail
            # only text that can hold a stop string not seen before: the earlier text was searched already (or came
            # before min_tokens, where stop strings do not end a request: one that ends past it still does)
            hit = None if req.num_output < p.min_tokens else _first_stop(
                text, p.stop, max(0, req.stop_scan - max(map(len, p.stop)) + 1))
            req.stop_scan = len(stable)
            if hit is not None:  # (cut before the stop string, or after it with include_stop_str_in_output)
                req.text, req.stop_cut = text[:hit[1] if p.include_stop_str_in_output else hit[0]], True
                return "stop"
        if req.num_output >= p.max_new_tokens:
            return "length"
        return None

    def extend(self, req: Request, tokens: list[int]) -> tuple[str | None, int]:
        """``append`` each token in order until one ends the request: (finish reason or None, tokens
        appended). Without stop strings the stop and length rules are found without a call per token."""
        p = req.params
        if p.stop:
            for i, tok in enumerate(tokens):
                reason = self.append(req, tok)
                if reason:
                    return reason, i + 1
            return None, len(tokens)
        seq = req.tokens
        # index of the token reaching max_new_tokens (the first one when the output is already that long)
        length_at = max(p.max_new_tokens - len(seq) + len(req.prompt_ids), 1) - 1
        eos, stop_ids = () if p.ignore_eos else req.eos_token_ids, p.stop_id_set
        if eos or stop_ids:
            for i, tok in enumerate(tokens):
                if tok in eos or tok in stop_ids:
                    if i <= length_at:
                        seq += tokens[:i + 1]
                        return "stop", i + 1
                    break
        if length_at < len(tokens):
            seq += tokens[:length_at + 1]
            return "length", length_at + 1
        seq += tokens
        return None, len(tokens)

    def finalize_text(self, req: Request, reason: str | None) -> None:
        """Refresh ``req.text`` unless a stop string already fixed it."""
        if reason == "stop" and req.stop_cut:
            return
        req.text = self.decode(req.output_ids, req.params.skip_special_tokens)


def _first_stop(text: str, stops: tuple[str, ...], start: int = 0) -> tuple[int, int] | None:
    """Where the first stop string found in ``text[start:]`` begins and ends (of those that begin there, the first
    given), or None."""
    hits = [(i, i + len(s)) for i, s in ((text.find(s, start), s) for s in stops) if i >= 0]
    return min(hits, key=lambda h: h[0]) if hits else None


def _plain_backend(tokenizer):
    """The Rust ``tokenizers.Tokenizer`` behind a Hugging Face fast tokenizer whose ``decode`` adds nothing
    to it (no clean-up of spaces, ``_decode`` not overridden), else None. Calling it directly skips about
    8 us of Python per decode, twice per running request per step."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decode = getattr(type(tokenizer), "_decode", None)
    if backend is None or decode is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    plain = {"transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast"}
    return backend if decode.__module__ in plain else None


def _byte_level(tokenizer) -> dict[str, int] | None:
    """The character -> byte map of a byte-level (GPT-2 style) tokenizer's alphabet (printable bytes stand for
    themselves, the others for 256 and up, in order), or None for other tokenizers."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None or "ByteLevel(" not in repr(decoder):  # (alone or in a Sequence)
        return None
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return {c: b for b, c in chars.items()}


def _token_bytes(tokenizer, token: int, text: str, byte_level: dict[str, int] | None) -> bytes:
    """The bytes one token stands for (``StopChecker._token``)."""
    to_piece = getattr(tokenizer, "convert_ids_to_tokens", None)
    piece = None if to_piece is None else to_piece(token)
    if isinstance(piece, str):
        if byte_level is not None and all(c in byte_level for c in piece):
            return bytes(byte_level[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # a byte-fallback token
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
    return text.encode("utf-8")
