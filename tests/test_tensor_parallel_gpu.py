"""Tensor parallelism on CUDA: NCCL groups, one GPU a rank, the collectives inside captured graphs.

On one GPU (a group of one rank) the sharded model's all-reduces and all-gather are captured in a CUDA graph and
replayed with new inputs; on two GPUs the same with the model split in halves, and whole engines of 2 ranks (float32,
the CUDA defaults: captured graphs, pipelined steps) give one GPU's greedy tokens; an engine on the second GPU,
stepped from another thread (a data-parallel replica's case), gives the first GPU's. The CPU runs the same engines
over gloo (test_tensor_parallel.py); here only what NCCL, graphs and several GPUs add."""

from __future__ import annotations

import copy

import pytest
import torch
from tp_helpers import engine_runs, graphed_sharded_logits, run_ranks

from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.base import LoadedModel
from specdec.sampling_params import SamplingParams

gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
cuda = pytest.mark.skipif(gpus < 1, reason="needs CUDA")
two_gpus = pytest.mark.skipif(gpus < 2, reason="needs 2 GPUs (NCCL ranks cannot share one)")

PROMPT, OTHER = [(5 * i + 2) % 250 + 1 for i in range(19)], [(11 * i + 7) % 250 + 1 for i in range(19)]
GEN_PROMPTS = [[(7 * i + 3) % 250 + 1 for i in range(n)] for n in (5, 23, 41, 12)]
CUDA_RUNS = [(None, dict(device="cuda", dtype="float32", block_size=16, num_blocks=64)),
             ("ngram", dict(device="cuda", dtype="float32", tree="chain:3", block_size=16, num_blocks=64)),
             ("model", dict(device="cuda", dtype="float32", tree="chain:4", block_size=16, num_blocks=64))]


@cuda
def test_cuda_nccl_collectives_in_a_graph_one_rank(tiny_factory):
    """A group of one rank on one GPU: the sharded model (the whole model, its collectives over one rank) captured
    with its all-reduces and all-gather replays the whole model's logits for the captured input and a new one."""
    from specdec.loading.registry import load_model

    model = load_model(tiny_factory("tp_gpu_llama", seed=3)).model
    [(captured, replayed)] = run_ranks(graphed_sharded_logits, 1, model, PROMPT, OTHER, backend="nccl", timeout=180)
    assert captured < 1e-4 and replayed < 1e-4, (captured, replayed)


@two_gpus
def test_cuda_nccl_tp2_graphed_logits(tiny_factory):
    """Two ranks on two GPUs: each rank's half of the model, captured with its collectives, replays the whole
    model's logits (KV heads split; a vocabulary that does not divide by 2)."""
    from specdec.loading.registry import load_model

    for folder in (tiny_factory("tp_gpu_llama", seed=3), tiny_factory("tp_gpu_qwen2", "qwen2", seed=5, vocab_size=255)):
        model = load_model(folder).model
        for captured, replayed in run_ranks(graphed_sharded_logits, 2, model, PROMPT, OTHER, backend="nccl",
                                            timeout=180):
            assert captured < 1e-4 and replayed < 1e-4, (folder, captured, replayed)


@two_gpus
def test_cuda_nccl_tp2_greedy_equals_one_gpu(tiny_target, tiny_draft):
    """Engines of 2 ranks over NCCL with the CUDA defaults (graphs captured at start, target-only and n-gram steps
    pipelined, n-gram's budgets held for epochs as rank 0 chose them) give one GPU's float32 greedy tokens (which
    no budget changes), target-only, n-gram and a draft model, every block free after. The ranks get the models on
    the CPU, as a target larger than one GPU comes, and each moves only its part to its GPU."""
    models = (copy.deepcopy(tiny_target.model).to("cuda"), copy.deepcopy(tiny_draft.model).to("cuda"))
    loaded = {"model": LoadedModel("tiny-draft", models[1], None, models[1].config)}
    target = LoadedModel("tiny", models[0], None, models[0].config)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    want = []
    for draft, options in CUDA_RUNS:
        eng = SpecEngine(loaded.get(draft, draft), target, SpecConfig(adaptive=False, **options))
        want.append([[o.token_ids for o in eng.generate(GEN_PROMPTS, params)] for _ in range(2 if draft == "ngram"
                                                                                              else 1)])
    ranks = run_ranks(engine_runs, 2, (tiny_target.model, tiny_draft.model), CUDA_RUNS, GEN_PROMPTS, 16,
                      backend="nccl", timeout=300)
    for rank, got in enumerate(ranks):
        for (tokens, free, _, _), expect, (draft, _) in zip(got, want, CUDA_RUNS):
            assert tokens == expect and free, (rank, draft)


@two_gpus
def test_cuda_engine_on_the_second_gpu_steps_from_another_thread(tiny_target):
    """An engine on cuda:1 (a data-parallel replica's place), built in one thread and stepped from another (a
    serving loop's, which starts on GPU 0): its graphs capture and replay on its own GPU, and its greedy tokens
    equal an engine's on cuda:0."""
    import threading

    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    got = {}
    for device in ("cuda:0", "cuda:1"):
        model = copy.deepcopy(tiny_target.model).to(device)
        eng = SpecEngine("ngram", LoadedModel("tiny", model, None, model.config),
                         SpecConfig(device=device, dtype="float32", tree="chain:3", block_size=16, num_blocks=64))
        worker = threading.Thread(target=lambda e=eng, d=device: got.__setitem__(
            d, [o.token_ids for o in e.generate(GEN_PROMPTS, params)]))
        worker.start()
        worker.join(300)
    assert got["cuda:1"] == got["cuda:0"] and len(got["cuda:0"]) == len(GEN_PROMPTS)
