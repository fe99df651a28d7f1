"""Plain and speculative decode throughput on the CPU, next to transformers ``generate``.

Run: python -m pytest bench/bench_decode.py --benchmark-columns=median,rounds
Each benchmark's ``extra_info['tokens']`` holds the tokens generated per round, so
tokens/s = tokens / median.
"""

from __future__ import annotations

import pytest
import torch

from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.benchmark.hf import to_hf_model

NEW_TOKENS = 32


@pytest.mark.parametrize("batch", [1, 8])
def test_specdec_plain_decode(benchmark, smollm2, chat_prompts, batch):
    engine = SpecEngine(None, smollm2, SpecConfig(prefix_cache=False))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = chat_prompts[:batch]
    outs = benchmark.pedantic(engine.generate, (prompts, params), rounds=3, warmup_rounds=1)
    benchmark.extra_info["tokens"] = sum(len(o.token_ids) for o in outs)


@pytest.mark.parametrize("draft", ["ngram", "truncated8"])
def test_specdec_speculative_decode(benchmark, smollm2, chat_prompts, draft):
    from specdec.loading.registry import truncate_layers

    d = "ngram" if draft == "ngram" else truncate_layers(smollm2, 8)
    engine = SpecEngine(d, smollm2, SpecConfig(tree="chain:4", prefix_cache=False))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    outs = benchmark.pedantic(engine.generate, (chat_prompts[:1], params), rounds=3, warmup_rounds=1)
    benchmark.extra_info["tokens"] = sum(len(o.token_ids) for o in outs)
    benchmark.extra_info["mean_accepted_length"] = outs[0].stats.mean_accepted_length


@pytest.mark.parametrize("batch", [1, 8])
def test_transformers_generate(benchmark, smollm2, chat_prompts, batch):
    model = to_hf_model(smollm2)
    pad = smollm2.tokenizer.eos_token_id
    prompts = chat_prompts[:batch]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run():
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False, pad_token_id=pad)

    out = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    benchmark.extra_info["tokens"] = int((out.shape[1] - width) * batch)
