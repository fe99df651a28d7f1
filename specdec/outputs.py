"""What generation returns: per-request outputs and acceptance statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.scheduler.request import Request
    from specdec.scheduler.stop import StopChecker


@dataclass
class AcceptanceStats:
    """Counts of one request (or an aggregate): drafted and accepted tokens per target forward."""

    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    committed: int = 0  # tokens committed by verify forwards (accepted + bonus)
    depth_steps: list[int] = field(default_factory=list)  # forwards whose tree reached depth d
    depth_accepted: list[int] = field(default_factory=list)  # forwards that accepted a token at depth d

    def record(self, num_drafted: int, max_depth: int, num_accepted: int, num_committed: int | None = None) -> None:
        """One target forward: ``num_accepted`` draft tokens kept, ``num_committed`` tokens appended
        (accepted + bonus, fewer when a stop rule ended the request inside the step)."""
        self.target_forwards += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.committed += num_accepted + 1 if num_committed is None else num_committed
        if not max_depth:  # an empty tree (target-only decoding): no depth reached
            return
        steps, accepted = self.depth_steps, self.depth_accepted
        if len(steps) < max_depth or len(accepted) < max_depth:
            _grow(steps, max_depth)
            _grow(accepted, max_depth)
        for d in range(max_depth):
            steps[d] += 1
        if num_accepted:
            for d in range(min(num_accepted, max_depth)):
                accepted[d] += 1

    def merge(self, other: AcceptanceStats) -> None:
        self.target_forwards += other.target_forwards
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.committed += other.committed
        for mine, theirs in ((self.depth_steps, other.depth_steps), (self.depth_accepted, other.depth_accepted)):
            _grow(mine, len(theirs))
            for d, n in enumerate(theirs):
                mine[d] += n

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward (accepted draft tokens + the bonus token)."""
        return self.committed / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        return [a / s if s else 0.0 for a, s in zip(self.depth_accepted, self.depth_steps)]

    def as_dict(self) -> dict:
        return {
            "target_forwards": self.target_forwards, "drafted": self.drafted, "accepted": self.accepted,
            "committed": self.committed, "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_by_depth": self.acceptance_by_depth,
            "depth_steps": list(self.depth_steps), "depth_accepted": list(self.depth_accepted),
        }


@dataclass(slots=True)
class Logprob:
    """One token's log-probability in an output (vLLM's ``Logprob``): under the target's raw distribution, its rank
    there (1 = the most probable), the token's own text and its bytes (OpenAI's ``bytes``: a token holding part of
    a UTF-8 character has text "\ufffd" but its own bytes), both shared by every entry of that token. Slotted: an
    output holds up to 21 of them per token, made on the host at every step that commits one; not frozen, as
    vLLM's is not (a frozen dataclass takes about four times as long to make)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None
    token_bytes: bytes | None = None


def _grow(xs: list[int], n: int) -> None:
    xs.extend([0] * (n - len(xs)))


@dataclass
class RequestOutput:
    """A request's output so far (streaming) or in full (``finished``).

    finish_reason: None while running, else "stop" (EOS, stop token or stop string),
    "length" (max_new_tokens), "error" (bad input; ``error`` says why) or "abort" (its stream was
    closed before it finished).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stats: AcceptanceStats
    error: ValueError | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    samples: list[RequestOutput] | None = None  # SamplingParams.n > 1: every sample's output (this one is sample 0)
    prompt: str | None = None  # vLLM's: the prompt's text (a chat rendered by its template); None when given as ids
    # SamplingParams.logprobs: per output token {token id: Logprob} (the chosen token's first, then the most probable
    # ones), the ones new since the last output, and the chosen tokens' sum; None when not asked for
    logprobs: list[dict[int, Logprob]] | None = None
    new_logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # SamplingParams.prompt_logprobs (the first None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape of the same output: one completion per sample (``out.outputs[i].text``)."""
        samples = self.samples or [self]
        return [CompletionOutput(i, s.text, s.token_ids, s.finish_reason, s.cumulative_logprob, s.logprobs)
                for i, s in enumerate(samples)]

    @staticmethod
    def of_samples(request_id: str, samples: list[RequestOutput]) -> RequestOutput:
        """One prompt's output from its n samples' final outputs: sample 0's fields (its error, or the first
        sample's error), every sample in ``samples``, their statistics merged."""
        first = samples[0]
        stats = AcceptanceStats()
        for s in samples:
            stats.merge(s.stats)
        error = next((s.error for s in samples if s.error is not None), None)
        return RequestOutput(request_id, first.prompt_token_ids, first.token_ids, first.text, first.finish_reason,
                             stats, error, first.new_token_ids, first.new_text, list(samples), first.prompt,
                             first.logprobs, first.new_logprobs, first.cumulative_logprob, first.prompt_logprobs)


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a request, as vLLM's ``RequestOutput.outputs[i]`` holds it (a view, not a copy:
    ``token_ids`` is the request output's list). ``logprobs`` and ``cumulative_logprob`` are None unless the request
    asked for them (``SamplingParams.logprobs``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None


def request_output(req: Request, stopper: StopChecker) -> RequestOutput:
    """What ``req`` has produced, as a ``RequestOutput``: its tokens and text so far, and what is new since the last
    output built for it (whose counts it advances)."""
    out_ids = req.tokens[len(req.prompt_ids):]  # a fresh list
    new_ids = out_ids[req.emitted_tokens:]
    if req.finished:
        text = req.text
    else:
        text, stops = stopper.running_text(req), req.params.stop
        text = stable_text(text, stops) if stops else text.rstrip("\ufffd")
    new_text = text[req.emitted_chars:]
    fields = logprob_fields(req, len(out_ids), req.emitted_tokens)
    req.emitted_tokens, req.emitted_chars = len(out_ids), len(text)
    return RequestOutput(req.request_id, list(req.prompt_ids), out_ids, text, req.finish_reason,
                         req.stats, req.error, new_ids, new_text, prompt=req.prompt_text, **fields)


def logprob_fields(req: Request, num_output: int, emitted: int = 0) -> dict:
    """The log-probability fields of an output of ``req`` holding its first ``num_output`` tokens, of which
    ``emitted`` were sent before (each list a fresh one, as the tokens'); None where the request did not ask."""
    lps = None if req.logprobs is None else req.logprobs[:num_output]
    return {"logprobs": lps, "new_logprobs": None if lps is None else lps[emitted:],
            "cumulative_logprob": None if lps is None else req.cumulative_logprob,
            "prompt_logprobs": None if req.prompt_logprobs is None else list(req.prompt_logprobs)}


def stable_text(text: str, stops: tuple[str, ...]) -> str:
    """The part of a running request's text that later tokens cannot change: without a trailing
    incomplete UTF-8 character and without a suffix that may grow into a stop string."""
    text = text.rstrip("\ufffd")
    cut = len(text)
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut]
