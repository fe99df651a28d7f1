"""How many steps of a pipelined engine run from the step queued behind the previous verify, on the CPU.

A queued step overlaps one step's host work with the next step's device work; a step that is not adopted from the
queue runs both in turn. Which steps are adopted depends on the batch's churn (requests finishing and joining), not
on the device, so a tiny random target (2 layers, 512-token vocabulary) and a random EAGLE draft on the CPU show it:
200 prompts of 8-200 tokens at 64 rows, continuous batching, greedy, each request with its own length (64-191 new
tokens, so that requests end at different steps), through the padded pipelined steps the CUDA defaults run.

    python -P bench/cpu_pipeline_adoption.py [none|ngram|eagle ...]

prints, per proposer, the engine steps, the steps queued (and the rows that joined a queued step right after
their prefill), and those adopted.
"""

from __future__ import annotations

import sys
import tempfile

import torch


def tiny_models():
    """The tiny random target (2 layers, 512-token vocabulary) and a random EAGLE draft on it (256-token vocabulary):
    (target, draft), both ``LoadedModel``s."""
    import transformers

    from specdec.loading.registry import LoadedModel, load_model
    from specdec.models.eagle import EagleShape, default_aux_layers, eagle_from_target

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    with tempfile.TemporaryDirectory() as folder:
        transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
        target = load_model(folder)
    shape = EagleShape(default_aux_layers(target.config.num_layers), 256)
    eagle = eagle_from_target(target.model, shape, torch.arange(0, 512, 2), seed=2).eval().requires_grad_(False)
    return target, LoadedModel("eagle", eagle, None, eagle.config)


def tiny_prompts(n: int) -> list[list[int]]:
    """``n`` random prompts of 8-200 tokens of the tiny models' vocabulary (seeded)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (int(torch.randint(8, 200, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def tiny_engine(kind: str, target, eagle, rows: int):
    """A pipelined engine with padded steps of ``rows`` rows: proposer ``kind`` (none, ngram or eagle: the tiny
    ``eagle`` draft), the tree of its CUDA defaults, a fixed budget."""
    from specdec import SpecConfig, SpecEngine

    draft = {"eagle": eagle, "ngram": "ngram", "none": None}[kind]
    tree = {"eagle": "dynamic:15", "ngram": "chain:8", "none": "auto"}[kind]
    return SpecEngine(draft, target, SpecConfig(tree=tree, cuda_graphs=True, pipeline=True, adaptive=False,
                                                ngram_device=kind == "ngram" or None, max_batch_size=rows,
                                                num_blocks=8192, block_size=16))


def main(kinds: list[str]) -> None:
    from specdec import SamplingParams

    torch.set_num_threads(1)
    target, eagle = tiny_models()
    prompts = tiny_prompts(200)
    params = [SamplingParams(max_new_tokens=64 + (i * 37) % 128, ignore_eos=True) for i in range(len(prompts))]
    for kind in kinds:
        eng = tiny_engine(kind, target, eagle, 64)
        steps, step = [0], eng.step

        def counted(step=step, steps=steps):
            steps[0] += 1
            return step()

        eng.step = counted
        eng.generate(prompts, params)
        p = eng.pipeline
        print(f"adoption {kind}: {steps[0]} steps, {p.queued} queued ({p.joined} rows joined), {p.adopted} adopted "
              f"({p.adopted / steps[0]:.0%}), {p.dropped} dropped", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["none", "ngram", "eagle"])
