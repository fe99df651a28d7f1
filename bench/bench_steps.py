"""pytest-benchmark entries for engine steps: a target-only decode step, a verify step per tree size.

Run: python -m pytest bench/bench_steps.py --benchmark-columns=median,iqr,rounds
On CUDA the model is SmolLM2-135M-shaped with random weights in bf16 (a step of random weights costs
what a step of the real ones costs); on the CPU a small random model in float32 keeps rounds short.
GPU-only entries skip cleanly without CUDA.

* decode step: one ``engine.step()`` of a target-only engine with ``batch`` rows mid-generation
  (128-token prompts already prefilled): one token per row.
* verify step: one ``engine.step()`` whose drafter proposes a chain of ``nodes`` random tokens per
  row, so the target verifies exactly ``nodes + 1`` tokens per row (random drafts are rejected:
  each step still commits one token per row).
"""

from __future__ import annotations

import pytest
import torch

from specdec.config import ModelConfig
from specdec.drafters.base import Proposal
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.registry import LoadedModel
from specdec.models.llama import LlamaForCausalLM
from specdec.sampling_params import SamplingParams
from specdec.tree import DraftTree

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="GPU step benchmarks need CUDA")
PROMPT_LEN, ROUNDS, WARMUP = 128, 20, 3
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0)
SMALL_SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=10000.0)
GPU_CASES = [pytest.param("cuda", b, marks=needs_cuda) for b in (1, 16, 64)]
CPU_CASES = [("cpu", 1), ("cpu", 4)]


def random_model(device: str) -> LoadedModel:
    """A random-weight Llama: SmolLM2-135M's shape in bf16 on CUDA, a small one in float32 on the CPU."""
    import transformers

    shape = SMOLLM2_SHAPE if device == "cuda" else SMALL_SHAPE
    cfg = ModelConfig.from_hf(transformers.LlamaConfig(**shape, max_position_embeddings=8192, eos_token_id=2))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16 if device == "cuda" else torch.float32).eval().requires_grad_(False)
    model.rope = model.rope.__class__(cfg).to(device)
    return LoadedModel("random", model, None, cfg)


class RandomChainDrafter(NgramDrafter):
    """Proposes ``k`` random tokens as a chain for every row (for timing verification only)."""

    def __init__(self, k: int, vocab: int, device) -> None:
        super().__init__(k, device=device)
        self.vocab = vocab

    def propose(self, rows) -> Proposal:
        trees = [DraftTree.from_parents(torch.randint(3, self.vocab, (self.k,)).tolist(), list(range(-1, self.k - 1)),
                                        device=self.device) for _ in rows]
        return Proposal(trees, [None] * len(rows))


def mid_generation(engine: SpecEngine, batch: int, vocab: int) -> SpecEngine:
    """``engine`` with ``batch`` requests prefilled and decoding (room for every benchmark round)."""
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(max_new_tokens=4 * (ROUNDS + WARMUP + 8), ignore_eos=True)
    reqs = [engine.add_request(torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist(), params)
            for _ in range(batch)]
    while any(r.num_computed < PROMPT_LEN for r in reqs):
        engine.step()
    engine.step()
    return engine


def _bench_step(benchmark, engine: SpecEngine, device: str) -> None:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step():
        engine.step()
        sync()

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=WARMUP)


@pytest.mark.parametrize("device,batch", GPU_CASES + CPU_CASES)
def test_decode_step(benchmark, device, batch):
    target = random_model(device)
    engine = SpecEngine(None, target, SpecConfig(device=device, dtype=_dtype(device), prefix_cache=False))
    _bench_step(benchmark, mid_generation(engine, batch, target.config.vocab_size), device)
    benchmark.extra_info.update(batch=batch, tokens_per_step=batch)


@pytest.mark.parametrize("nodes", [4, 16, 63])
@pytest.mark.parametrize("device,batch", GPU_CASES + CPU_CASES)
def test_verify_step(benchmark, device, batch, nodes):
    if device == "cpu" and nodes == 63:
        pytest.skip("CPU entries stay small")
    target = random_model(device)
    cfg = SpecConfig(tree=f"chain:{nodes}", device=device, dtype=_dtype(device), prefix_cache=False)
    engine = SpecEngine("ngram", target, cfg)
    # same max_nodes as the n-gram drafter it replaces, so the scheduler's reservations still hold
    engine.drafter = RandomChainDrafter(nodes, target.config.vocab_size, engine.device)
    _bench_step(benchmark, mid_generation(engine, batch, target.config.vocab_size), device)
    benchmark.extra_info.update(batch=batch, nodes=nodes, tokens_verified_per_step=batch * (nodes + 1))


def _level_tree(nodes: int, levels: int, vocab: int, g: torch.Generator) -> DraftTree:
    """A tree of ``nodes`` random tokens spread over ``levels`` levels, each node's parent on the level above."""
    per = [nodes // levels + (i < nodes % levels) for i in range(levels)]
    parents, start = [], -1
    for d, width in enumerate(per):
        above = list(range(start, start + per[d - 1])) if d else [-1]
        parents += [above[i % len(above)] for i in range(width)]
        start = len(parents) - width
    return DraftTree.from_parents(torch.randint(vocab, (nodes,), generator=g).tolist(), parents)


@pytest.mark.parametrize("top_p", [1.0, 0.9], ids=["plain", "top_p"])
@pytest.mark.parametrize("device,batch", GPU_CASES + [("cpu", 4)])
def test_sampled_rule(benchmark, device, batch, top_p):
    """The lossless rule of a step whose rows all sample (T = 0.7, with and without top-p 0.9) over 31-node trees
    of 5 levels (the shipped draft's CUDA default shape): the token choice at every verify token and the walk;
    on CUDA a captured graph's replay, over bf16 logits of the real vocabulary, the choice's Triton kernel."""
    from types import SimpleNamespace

    from specdec.sampled_rule import SampledRule
    from specdec.uniform_stream import UniformStream

    vocab, q, nodes, levels = (49152, 32, 31, 5) if device == "cuda" else (512, 16, 15, 3)
    g = torch.Generator().manual_seed(0)
    trees = [_level_tree(nodes, levels, vocab, g) for _ in range(batch)]
    logits = (3.0 * torch.randn(batch * q, vocab, generator=g)).to(device, torch.bfloat16 if device == "cuda"
                                                                   else torch.float32)
    accept = torch.zeros(batch, q + 3, dtype=torch.int64, device=device)
    rows = [SimpleNamespace(params=SamplingParams(temperature=0.7, top_p=top_p, seed=i), stream=UniformStream(i),
                            tokens=[1] * (100 + i)) for i in range(batch)]
    rule = SampledRule(device, use_triton=device == "cuda")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run():
        rule(rows, trees, range(batch), logits, accept, captured=True)
        sync()

    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=WARMUP)
    benchmark.extra_info.update(batch=batch, verify_tokens=q, top_p=top_p)


@pytest.mark.parametrize("context", [600, 4000])
@pytest.mark.parametrize("kept", [False, True], ids=["built", "kept"])
def test_penalty_context(benchmark, kept, context):
    """A step's repetition-penalty context for 16 rows of ``context``-token prompts, each row one token longer at
    every round (the real vocabulary): built from every row's whole token list (``ContextPenalty.of``), or kept on
    the device across steps (``ContextState``: the new tokens sent, the rows gathered). Host time mostly: the part
    of a step that grows with the contexts' length."""
    from types import SimpleNamespace

    from specdec.repetition_penalty import ContextPenalty, ContextState

    device, vocab, g = ("cuda" if CUDA else "cpu"), 49152, torch.Generator().manual_seed(0)
    rows = [SimpleNamespace(tokens=torch.randint(vocab, (context,), generator=g).tolist(), num_prompt=context,
                            bt_row=i, params=SamplingParams(max_tokens=4096, repetition_penalty=1.2),
                            eos_token_ids=(2,), bad_word_ids=(), output_ids=[], num_output=0) for i in range(16)]
    state = ContextState(24, device) if kept else None
    sync = torch.cuda.synchronize if CUDA else (lambda: None)

    def run():
        for r in rows:
            r.tokens.append(int(torch.randint(vocab, (1,), generator=g)))
            r.output_ids, r.num_output = r.tokens[r.num_prompt:], len(r.tokens) - r.num_prompt
        ContextPenalty.of(rows, range(16), 16, vocab, device, state=state)
        sync()

    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=WARMUP)
    benchmark.extra_info.update(rows=16, context=context, kept=kept)


@pytest.mark.parametrize("kept", [False, True], ids=["built", "kept"])
def test_allowed_set_rows(benchmark, kept):
    """A step's logit-bias rows for 16 rows each allowed 10,000 token ids (a constrained vocabulary), the real
    vocabulary: built from every row's params at each step (``ContextPenalty.of``), or made once per request and
    kept on the device (``ContextState.bias_of``)."""
    from types import SimpleNamespace

    from specdec.repetition_penalty import ContextPenalty, ContextState

    device, vocab, g = ("cuda" if CUDA else "cpu"), 49152, torch.Generator().manual_seed(0)
    rows = [SimpleNamespace(tokens=[1, 2], num_prompt=2, bt_row=i, output_ids=[], num_output=0, eos_token_ids=(2,),
                            bad_word_ids=(), params=SamplingParams(allowed_token_ids=torch.randperm(
                                vocab, generator=g)[:10000].tolist())) for i in range(16)]
    state = ContextState(24, device) if kept else None
    sync = torch.cuda.synchronize if CUDA else (lambda: None)

    def run():
        ContextPenalty.of(rows, range(16), 16, vocab, device, state=state)
        sync()

    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=WARMUP)
    benchmark.extra_info.update(rows=16, allowed=10000, kept=kept)


def _dtype(device: str) -> str:
    return "bfloat16" if device == "cuda" else "float32"


@pytest.mark.parametrize("k", [5, 20])
def test_logprob_entries(benchmark, k):
    """The host side of a step's log-probabilities for 16 committed tokens, each with its ``k`` most probable
    tokens: read entries (``logprobs.ranked``'s ``{token: (log-probability, rank)}``) turned into vLLM's
    ``{token: Logprob}`` and appended to the request (``StopChecker.add_logprobs``), every token's text already
    cached. A pipelined step whose host work is its bottleneck pays this at every step."""
    import random
    from types import SimpleNamespace

    from specdec.scheduler.stop import StopChecker

    rng, stopper = random.Random(0), StopChecker(None)
    entries = [{rng.randrange(49152): (-rng.random(), r + 1) for r in range(k + 1)} for _ in range(16)]
    req = SimpleNamespace(logprobs=[], cumulative_logprob=0.0)

    def run():
        req.logprobs.clear()
        stopper.add_logprobs(req, entries)

    benchmark.pedantic(run, rounds=200, warmup_rounds=20)
    benchmark.extra_info.update(tokens=16, k=k)
