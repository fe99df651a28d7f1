"""The request-state object that travels through schedule -> propose -> verify -> commit."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specdec.outputs import AcceptanceStats
from specdec.sampling_params import SamplingParams
from specdec.uniform_stream import UniformStream


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request: its tokens, its KV blocks, its progress for both models.

    ``tokens`` is prompt + output. The target's KV covers ``tokens[:num_computed]``; the
    draft's covers ``tokens[:num_computed_draft]``. While running, the last token is pending
    (its KV is computed by the next verify forward).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    bt_row: int = -1
    num_computed: int = 0
    num_computed_draft: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: Exception | None = None  # why the request failed (finish_reason "error")
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    stream: UniformStream | None = None  # sampled: the key of its noise (kernels.gumbel_choice, uniform_stream)
    arrival: int = 0
    decoding: bool = False  # among the batch's decode rows (a running request prefilled ahead waits until a row frees)
    text: str = ""
    prompt_text: str | None = None  # the prompt as text (a chat's rendered by its template); None: given as ids
    emitted_tokens: int = 0  # output tokens already streamed
    emitted_chars: int = 0
    detok: list = field(default_factory=lambda: [0, 0, ""])  # incremental decoding: prefix/read offsets, text
    stop_scan: int = 0  # characters of the output text already searched for stop strings (StopChecker)
    stop_cut: bool = False  # a stop string ended it: ``text`` is the output's text cut before it
    bad_word_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences (``bad_word_ids``)
    # params.logprobs: per output token {token id: Logprob} (the chosen token's first, then the most probable ones)
    logprobs: list[dict] | None = None
    cumulative_logprob: float = 0.0
    # params.prompt_logprobs: per prompt token {token id: Logprob}, None for the first (and until its chunk ran)
    prompt_logprobs: list[dict | None] | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def penalized(self) -> bool:
        """Its next step's logits are changed (``SamplingParams.logits_processed``, or ``min_tokens`` still holds the
        ending tokens back): the step's fast paths, which read the raw logits, do not serve it."""
        return self.params.logits_processed or self.holding_back

    @property
    def holding_back(self) -> bool:
        """``min_tokens`` still holds the ending tokens back at its next step."""
        p = self.params
        return p.min_tokens > 0 and self.num_output < p.min_tokens

    @property
    def reads_context(self) -> bool:
        """Its next step's processed logits depend on the tokens committed before that step
        (``SamplingParams.reads_context``, or ``min_tokens`` still holding the ending tokens back): a step queued
        on the device before the step ahead of it is committed counts that step's tokens on the device
        (``repetition_penalty.committed_ahead``); a row ``penalized`` only by a bias or an allowed set needs none."""
        return self.params.reads_context or self.holding_back

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits at its next step: the steps' greedy fast paths (the verify's own argmax) serve
        it."""
        return self.params.greedy and not self.penalized

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= len(self.tokens) - 1

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
