"""Engine warm-up: every step shape a configuration can run, run once before the first request.

Some graphs of a padded step are captured on their first use, because their keys depend on what a step
holds: a queued step's advance per bucket and tree, a dynamic tree's writer per budget, the sampled rule per
(bucket, filter flag, and the layout of the processors' inputs). Captured in the middle of a user's first requests
they would make those requests several times slower than later ones, and so would Triton kernels compiled there.
``warm_up`` drives short synthetic requests through ``SpecEngine.generate`` at every batch bucket's row count,
greedy and sampled (with and without top-p), under every budget the engine may choose (rows with penalties under
the smallest and the largest), and batches that shrink from every bucket to every smaller one in one step (a
queued decode or chain step's writer is keyed by its bucket and the previous step's), so those graphs exist when
the first request arrives; then it forgets everything the synthetic requests left behind (statistics, drafted
text, kept penalty contexts, cached prefixes, the blocks they held).
"""

from __future__ import annotations

import dataclasses
import time

from specdec.sampling_params import SamplingParams

WARM_UP_TOKENS = 4  # new tokens per synthetic request: a prefill step, then decode steps of the same rows
PROMPT_TOKENS = 8
# prompts of mixed lengths, run once greedy and once sampled: the eager forwards (a draft's prefill, the rows
# that skip a graph) hand Triton token counts and lengths of every class its kernels specialise on (1, a
# multiple of 16, any other), and key ranges long enough for attention to split them (its partial-output variant
# and the kernel that combines the splits, per split count), so none of those kernels is compiled during the first
# requests (lengths past the model's maximum are left out)
MIXED_LENGTHS = (1, 13, 16, 17, 40, 96, 161, 300, 600, 1200, 2400)
# a batch's eager prefill step splits its keys by its longest row's queries and keys together, so a batch of long
# and short prompts reaches few split counts: the prompts from SPLIT_ALONE tokens up are prefilled alone too (a
# draft's prefill of each on its own: 2, 4, 8 and 16 splits of an H200 at 600 to 2,400 tokens; the split-combining
# kernel is compiled once per power of two of splits), and prompts that end TAIL_QUERIES tokens past a full
# prefill step, whose last chunk is few queries over many keys (the multi-query tile sizes, split)
SPLIT_ALONE = 512
TAIL_QUERIES = (16, 40)


class FixedBudget:
    """A stand-in budget controller that gives every step ``nodes`` nodes and learns nothing."""

    timing_valid = True

    def __init__(self, nodes: int | None) -> None:
        self.nodes = nodes

    def speculate(self, rows: list, proposer, verifier) -> list:
        """One propose -> verify step of ``rows`` at the fixed budget."""
        proposer.budget = self.nodes
        return verifier.verify_proposal(rows, proposer.propose(rows))

    def observe_step(self, seconds: float) -> None:
        """Nothing to learn."""


def warm_up(engine) -> float:
    """Run ``engine`` (a SpecEngine) through every batch bucket and budget it can step, greedy and sampled; returns
    the seconds it took. The engine's budget controller is set aside while it runs and learns nothing from it."""
    start = time.perf_counter()
    cfg = engine.config
    prompt = [t % engine.target.config.vocab_size for t in range(1, PROMPT_TOKENS + 1)]
    controller = engine.adaptive
    budgets = [None] if controller is None else sorted({o.nodes for o in controller.options})
    greedy = SamplingParams(max_new_tokens=WARM_UP_TOKENS, ignore_eos=True)
    sampled = [SamplingParams(max_new_tokens=WARM_UP_TOKENS, ignore_eos=True, temperature=1.0, top_p=top_p, seed=i)
               for i, top_p in enumerate((1.0, 0.9))]  # without and with top-p: the rule's two graphs
    # rows with logits processors (penalties: every processor runs through the same rule and kernel): the rule's graph
    # of their inputs' layout, its greedy-row variant and the processors' kernel, at the smallest and the largest
    # budget (one and many verify tokens a row) of every bucket
    plain_pen = dataclasses.replace(greedy, presence_penalty=0.5, repetition_penalty=1.1)
    sampled_pen = dataclasses.replace(sampled[1], presence_penalty=0.5, repetition_penalty=1.1)
    buckets = set(engine.runner.graphs.batch_buckets) if engine.runner.graphs is not None else set()
    counts = sorted(buckets | {cfg.max_batch_size})  # every graph is keyed by the batch bucket, not the row count
    try:
        for rows in counts:
            for nodes in budgets:  # all-greedy steps and steps with a sampled row, at any budget the engine may use
                engine.adaptive = None if controller is None else FixedBudget(nodes)
                engine.generate([prompt] * rows, greedy)
                engine.generate([prompt] * rows, [sampled[0]] + [greedy] * (rows - 1))
                engine.generate([prompt] * rows, sampled[1])  # the sampled rule with top-p on
                if nodes in (budgets[0], budgets[-1]):
                    engine.generate([prompt] * rows, plain_pen)
                    engine.generate([prompt] * rows, [sampled_pen] + [plain_pen] * (rows - 1))
        if engine.pipeline is not None:
            _shrinking(engine, controller, budgets, counts, prompt)
        engine.adaptive = None if controller is None else FixedBudget(None)
        vocab, limit = engine.target.config.vocab_size, engine.target.config.max_position_embeddings
        room = limit - WARM_UP_TOKENS - engine.drafter.lookahead
        mixed = [_prompt(i, n, vocab) for i, n in enumerate(MIXED_LENGTHS) if n < room]
        for params in (greedy, sampled[1]):
            for i in range(0, len(mixed), cfg.max_batch_size):
                engine.generate(mixed[i:i + cfg.max_batch_size], params)
        alone = [n for n in MIXED_LENGTHS if SPLIT_ALONE <= n < room]
        alone += [n for n in (cfg.max_num_tokens + 1 + t for t in TAIL_QUERIES) if n < room]
        for i, n in enumerate(alone):  # new ids: no prefix shared with the prompts above (their whole prefill)
            engine.generate([_prompt(len(MIXED_LENGTHS) + i, n, vocab)], greedy)
    finally:
        engine.adaptive = controller
        engine.drafter.budget = None
    return time.perf_counter() - start


def _shrinking(engine, controller, budgets: list, counts: list[int], prompt: list[int]) -> None:
    """Under each budget whose queued steps are keyed by the bucket of the step they follow too
    (``follows_bucket``; one budget per query bucket): for every pair of row counts, the wider one's rows decode
    until all but the narrower one's end in one step, so the step queued next is the narrow bucket's behind the wide
    bucket's verify (the writer graph of that pair); the rows that go on are aborted after it. Driven step by step,
    so each pair costs a few steps however many tokens a step commits."""
    sched = engine.scheduler
    once = SamplingParams(max_new_tokens=1, ignore_eos=True)
    room = engine.target.config.max_position_embeddings - len(prompt) - engine.drafter.lookahead
    going = SamplingParams(max_new_tokens=max(1, min(8 * WARM_UP_TOKENS, room)), ignore_eos=True)
    hook, seen = engine.pipeline.hook, set()
    fits = [c for c in counts if c <= engine.config.max_batch_size]
    for nodes in budgets:
        engine.adaptive = None if controller is None else FixedBudget(nodes)
        engine.drafter.budget = nodes
        key = engine.runner.packed_key(0, 1, max(1, hook.min_query([])), engine.drafter.target_features)
        if not hook.follows_bucket or key is None or key[2] in seen:  # (budgets of one query bucket: one pass)
            continue
        seen.add(key[2])
        for i, wide in enumerate(fits):
            for narrow in fits[:i]:
                reqs = [engine.add_request(prompt, going if j < narrow else once) for j in range(wide)]
                while sched.has_work and not all(r.finished for r in reqs[narrow:]):
                    engine.step()
                for _ in range(2):  # the narrow bucket's step queued behind the wide verify, then adopted
                    engine.step()
                for r in reqs[:narrow]:
                    if not r.finished:
                        sched.abort(r)
                while sched.has_work:
                    engine.step()


def _prompt(i: int, n: int, vocab: int) -> list[int]:
    """Synthetic prompt ``i`` of ``n`` token ids, none of them 0."""
    return [(7 * i + j) % (vocab - 1) + 1 for j in range(n)]
