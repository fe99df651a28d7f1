"""``specdec distill``: train a small draft model for a target by self-distillation.

1. Data (``training.distill_data``): the target, run by our engine alone (greedy by default),
   answers training prompts; prompt and response ids are cached in ``OUT/data.pt``.
2. Draft (``training.layers``): ``--layers`` decoder layers copied from the target (evenly spaced,
   first and last included) and its final norm; embeddings / LM head are the target's, frozen.
3. Loss (``training.training``): KL(target || draft) of the next-token distributions at every
   response position, the target's logits computed on the fly. AdamW, linear warm-up then cosine
   decay, bf16 autocast on CUDA (float32 master weights), float32 on CPU. ``OUT/ckpt.pt`` every
   ``--ckpt-every`` steps; ``--resume`` continues exactly.
4. Export (``training.folder``): a draft folder that stores only the trained tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.loading.base import DTYPES, LoadedModel
from specdec.training.configs import DistillConfig
from specdec.training.distill_data import DistillData
from specdec.training.training import TrainState

TRAINING_FILES = ("data.pt", "ckpt.pt")  # in OUT next to the draft, but not part of it


@dataclass(frozen=True)
class DistillResult:
    """What a run produced: the draft folder (None when stopped before the last step), KLs, times."""

    folder: Path | None
    first_kl: float
    final_kl: float
    state: TrainState
    gen_seconds: float
    wall_seconds: float


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _ends(losses: list[float]) -> tuple[float, float]:
    """Mean training KL of the first and of the last k steps (k = 50, or a fifth of short runs)."""
    k = max(1, min(50, len(losses) // 5))
    return _mean(losses[:k]), _mean(losses[-k:])


def loss_curve(losses: list[float], points: int = 100) -> list[list[float]]:
    """``[[last step of window, mean KL of window], ...]`` with at most ``points`` windows."""
    w = max(1, -(-len(losses) // points))
    return [[min(i + w, len(losses)), round(_mean(losses[i:i + w]), 6)] for i in range(0, len(losses), w)]


def _device_name(device: str) -> str:
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.startswith("cuda") else device


def export(cfg: DistillConfig, target: LoadedModel, draft: LoadedModel, data: DistillData, layers: list[int],
           state: TrainState, wall: float) -> Path:
    """Write the draft folder into ``cfg.out``; returns the path of its ``model.safetensors``."""
    from specdec.loading.draft_folder import save_draft_folder

    ref = str(Path(cfg.target).resolve()) if Path(cfg.target).exists() else cfg.target
    first, final = _ends(state.losses)
    record = {
        "data": cfg.data, "source": data.source, "num_prompts": len(data.prompts),
        "val_prompts": cfg.num_val, "response_tokens": cfg.response_tokens,
        "generated_tokens": data.num_response_tokens, "max_prompt_tokens": cfg.max_prompt_tokens,
        "generation": "greedy" if cfg.temperature == 0 else f"sampled, temperature {cfg.temperature}",
        "steps": state.step, "batch_size": cfg.batch_size, "lr": cfg.lr, "warmup_steps": cfg.warmup_steps,
        "schedule": f"linear warm-up, cosine to {cfg.min_lr_ratio} x lr", "weight_decay": cfg.weight_decay,
        "grad_clip": cfg.grad_clip, "seed": cfg.seed, "loss": "KL(target || draft) per response token",
        "first_kl": first, "final_kl": final, "val_kl": state.val, "loss_curve": loss_curve(state.losses),
        "device": _device_name(cfg.device),
        "precision": "bf16 autocast, fp32 master weights" if cfg.autocast else "float32",
        "wall_seconds": {"data": round(data.gen_seconds, 2), "train": round(state.train_seconds, 2),
                         "this_run": round(wall, 2)},
    }
    return save_draft_folder(cfg.out, draft, target, ref, {"target_layers": layers, "training": record},
                             DTYPES[cfg.save_dtype])


def _teacher(target: LoadedModel, cfg: DistillConfig) -> LoadedModel:
    """The target in ``cfg.dtype`` (what the engine runs), sharing nothing with the fp32 copy."""
    from specdec.loading.base import build_model

    if cfg.dtype == "float32":
        return target
    model = build_model(target.config, target.model.state_dict(), DTYPES[cfg.dtype], cfg.device)
    return LoadedModel(target.name, model, target.tokenizer, target.config)


def distill(cfg: DistillConfig) -> DistillResult:
    """Generate the data (or reuse ``data.pt``), train (or resume ``ckpt.pt``) and, once every step
    is done, export the draft folder into ``cfg.out``."""
    from specdec.loading.draft_layers import draft_from_target, target_layer_map
    from specdec.loading.registry import load_model
    from specdec.training.distill_data import load_or_generate
    from specdec.training.training import train

    t0 = time.perf_counter()
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    target = load_model(cfg.target, dtype=torch.float32, device=cfg.device)  # holds the shared tensors
    layers = target_layer_map(target.config.num_layers, cfg.layers, cfg.init_layers)
    teacher = _teacher(target, cfg)
    data = load_or_generate(Path(cfg.out), cfg.data_spec, teacher, cfg.gen_batch_size, cfg.device,
                            cfg.dtype, strict=cfg.resume)
    num_train = len(data.prompts) - cfg.num_val
    if num_train < 1:
        raise ValueError(f"DistillConfig.val_prompts={cfg.num_val} leaves no training example out of "
                         f"the {len(data.prompts)} prompts of {cfg.data}")
    draft = draft_from_target(target, layers, name=str(cfg.out))
    state = train(cfg, teacher, draft, data, num_train)
    folder = None
    if state.step >= cfg.steps:
        export(cfg, target, draft, data, layers, state, time.perf_counter() - t0)
        folder = Path(cfg.out)
    first, final = _ends(state.losses)
    return DistillResult(folder, first, final, state, data.gen_seconds, time.perf_counter() - t0)


def _draft_mb(folder: Path) -> float:
    files = [f for f in folder.iterdir() if f.is_file() and f.name not in TRAINING_FILES]
    return sum(f.stat().st_size for f in files if f.suffix != ".tmp") / 2**20


def summary_line(res: DistillResult) -> str:
    """One line: wall time, KL first -> final (and validation), output sizes or where it stopped."""
    s = res.state
    line = (f"distill: {res.wall_seconds:.1f}s wall (data {res.gen_seconds:.1f}s, "
            f"train {s.train_seconds:.1f}s) | step {s.step} | KL {res.first_kl:.4f} -> {res.final_kl:.4f}")
    if s.val:
        line += f" | val KL {s.val[0][1]:.4f} -> {s.val[-1][1]:.4f}"
    if res.folder is None:
        return line + " | stopped before the last step: continue with --resume"
    weights = (res.folder / "model.safetensors").stat().st_size / 2**20
    return line + (f" | {res.folder}: model.safetensors {weights:.2f} MB, draft "
                   f"{_draft_mb(res.folder):.2f} MB (without {' and '.join(TRAINING_FILES)})")
