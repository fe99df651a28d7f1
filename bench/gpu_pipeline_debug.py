"""Checks of the pipelined fused EAGLE step (specdec/lookahead.py) on the GPU with the real model and the shipped
draft: which host calls still wait for the GPU (``torch.cuda.set_sync_debug_mode``), and a batch-64 run that
reports the first failing call (run it with CUDA_LAUNCH_BLOCKING=1 for a synchronous traceback).

    python -P bench/gpu_pipeline_debug.py syncs OUT MODEL PROMPTS        # batch 1, 12 steps under the detector
    python -P bench/gpu_pipeline_debug.py batch OUT MODEL PROMPTS [B [TREE]]  # waves of B (default 64), 128 tokens
"""

from __future__ import annotations

import collections
import json
import sys
import traceback
import warnings
from pathlib import Path

import torch

from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.loading.registry import load_model


def engines(model_path: str, batch: int, tree: str = "dynamic:31"):
    target = load_model(model_path, dtype=torch.bfloat16, device="cuda")
    draft = load_model("smollm2-135m-draft", dtype=torch.bfloat16, device="cuda", target=target)
    return SpecEngine(draft, target, SpecConfig(device="cuda", dtype="bfloat16", max_batch_size=batch,
                                                prefix_cache=False, tree=tree, adaptive=False,
                                                pipeline=True))


def main() -> None:
    mode, out, model, prompt_file = sys.argv[1:5]
    Path(out).mkdir(parents=True, exist_ok=True)
    prompts = json.loads(Path(prompt_file).read_text())["mtbench"]
    if mode == "syncs":
        eng = engines(model, 1)
        eng.generate(prompts[:1], SamplingParams(max_new_tokens=8, ignore_eos=True))
        eng.add_request(prompts[1], SamplingParams(max_new_tokens=200, ignore_eos=True))
        for _ in range(6):
            eng.step()
        where: collections.Counter = collections.Counter()

        def show(message, category, filename, lineno, file=None, line=None):
            stack = [f for f in traceback.extract_stack()[:-2] if "specdec" in f.filename]
            where[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack[-4:]))] += 1

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        for _ in range(12):
            eng.step()
        torch.cuda.set_sync_debug_mode(0)
        print(f"paths {dict(eng.drafter.paths)}")
        for k, v in where.most_common():
            print(f"sync x{v / 12:.1f}/step: {k}")
        return
    b = int(sys.argv[5]) if len(sys.argv) > 5 else 64
    tree = sys.argv[6] if len(sys.argv) > 6 else "dynamic:31"
    eng = engines(model, b, tree)
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    for i in range(0, len(prompts), b):
        try:
            outs = eng.generate(prompts[i:i + b], params)
        except Exception:  # noqa: BLE001 - the point is the traceback
            traceback.print_exc()
            print(f"batch {b}: FAILED in the wave at {i}; paths {dict(eng.drafter.paths)}")
            return
        errors = [o.error for o in outs if o.error is not None]
        if errors:
            print("".join(traceback.format_exception(errors[0])))
        print(f"batch {b} wave {i}: {len(outs)} outputs, {len(errors)} errors {errors[:1]}; "
              f"paths {dict(eng.drafter.paths)}", flush=True)


if __name__ == "__main__":
    main()
