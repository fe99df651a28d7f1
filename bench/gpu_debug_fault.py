"""Bisect a GPU fault of the EAGLE engine (session 6: an illegal memory access in dynamic:31 with the adaptive
budget at batch 64). One configuration per process (a fault kills the CUDA context):

    python3 -P bench/gpu_debug_fault.py OUT_DIR MODEL PROMPTS CONFIG [BATCH]

CONFIG: adaptive | adaptive-noprepare | adaptive-unfused | adaptive-torchtopk | fixed | topk-adaptive.
Runs a warm-up, waves of BATCH and one continuous run over the 80 prompts (128 new tokens), then prints
``CONFIG ok`` or the traceback (run with CUDA_LAUNCH_BLOCKING=1 to name the failing launch).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_fastpath import DEV, user_generate  # noqa: E402

from specdec import SamplingParams, SpecConfig, SpecEngine  # noqa: E402
from specdec.loading.registry import load_model  # noqa: E402


def main() -> None:
    out, model_path, prompt_file, config = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    batch = int(sys.argv[5]) if len(sys.argv) > 5 else 64
    out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(Path(prompt_file).read_text())["mtbench"]
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    if config == "adaptive-noprepare":
        from specdec.fused_step import FusedVerify
        FusedVerify.prepare = lambda self, budgets: 0
    if config == "adaptive-torchtopk":
        from specdec.kernels.backend import TritonAttentionBackend

        from specdec.attention.base import AttentionBackend
        TritonAttentionBackend.topk = AttentionBackend.topk
    fields = {"tree": "topk:2x3" if config.startswith("topk") else "dynamic:31", "adaptive": config != "fixed",
              "fused_verify": config != "adaptive-unfused"}
    target = load_model(model_path, dtype=torch.bfloat16, device=DEV)
    draft = load_model("smollm2-135m-draft", dtype=target.dtype, device=DEV, target=target)
    try:
        eng = SpecEngine(draft, target, SpecConfig(device=DEV, dtype="bfloat16", max_batch_size=batch,
                                                   prefix_cache=False, **fields))
        eng.generate(prompts[:batch], SamplingParams(max_new_tokens=8, ignore_eos=True))
        for continuous in (False, True):
            r = user_generate(eng, prompts, params, batch, continuous)
            print(f"{config} continuous={continuous}: {r['tok_per_s']:.0f} tok/s", flush=True)
        torch.cuda.synchronize()
        print(f"{config} ok (mean budget {eng.adaptive.mean_budget() if eng.adaptive else None})", flush=True)
    except Exception:
        print(f"{config} FAILED", flush=True)
        traceback.print_exc()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
