"""Launch counts of the EAGLE device draft programs on the CPU (issue 10), a stand-in for the GPU's kernels.

    OMP_NUM_THREADS=1 python -P bench/cpu_program_launches.py [TREE ...]   # default: dynamic:31 topk:2x3

The same random SmolLM2-shaped target and untrained EAGLE draft as gpu_program_kernels.py (float32, batch 1),
on the Triton backend under TRITON_INTERPRET=1: one run of the program counts each Triton launch and each
aten op outside the kernels that computes something (views, allocations and host reads left out), by name.
A GPU run adds what float32 on the CPU hides (bf16 casts) and splits some ops (torch.sort, top-k merges).
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from gpu_fastpath import DEV, random_model, random_prompts  # noqa: E402

from specdec import SamplingParams, SpecConfig, SpecEngine  # noqa: E402
from specdec.loading.registry import LoadedModel  # noqa: E402
from specdec.training.eagle import EagleShape, default_aux_layers, eagle_from_target  # noqa: E402

FREE = {"view", "_unsafe_view", "detach", "alias", "lift_fresh", "empty", "empty_like", "empty_strided", "item",
        "is_nonzero", "_local_scalar_dense"}
counts: collections.Counter = collections.Counter()
_inside = [0]  # > 0 while a Triton kernel runs: its own tensor ops are not launches
_run = interpreter.InterpretedFunction.run


def _counted_run(self, *args, **kwargs):
    counts["triton:" + self.fn.__name__] += 1
    _inside[0] += 1
    try:
        return _run(self, *args, **kwargs)
    finally:
        _inside[0] -= 1


class _Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not _inside[0] and not func.is_view and name not in FREE:
            counts[name] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    interpreter.InterpretedFunction.run = _counted_run
    target = random_model(torch.float32)
    cfg = target.config
    shape = EagleShape(default_aux_layers(cfg.num_layers), min(24576, cfg.vocab_size))
    model = eagle_from_target(target.model, shape, torch.arange(shape.draft_vocab), seed=1)
    draft = LoadedModel("eagle-random", model.eval().requires_grad_(False), None, model.config)
    prompts = random_prompts(1, 10, cfg.vocab_size, seed=1)
    for tree in sys.argv[1:] or ["dynamic:31", "topk:2x3"]:
        eng = SpecEngine(draft, target, SpecConfig(device=DEV, dtype="float32", tree=tree, max_batch_size=8,
                                                   prefix_cache=False, adaptive=False, cuda_graphs=True,
                                                   attention_backend="triton"))
        eng.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))  # fills bucket 1's inputs
        loop = eng.drafter.device_loop
        counts.clear()
        with _Ops():
            loop._program(1)
        print(f"{tree}: {sum(counts.values())} launches: {dict(counts.most_common())}", flush=True)


if __name__ == "__main__":
    main()
