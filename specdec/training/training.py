"""The distillation loop: KL(teacher || draft) on response positions, AdamW, exact checkpoints.

Batch ``s`` is a pure function of (seed, s) (one permutation of the training examples per epoch)
and the learning rate a pure function of s, so a run resumed from ``ckpt.pt`` (weights,
optimizer, step, RNG, loss history) continues exactly as if it had never stopped.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdec.loading.base import LoadedModel
from specdec.loading.draft_layers import trained_state
from specdec.training.dense_attention import dense_hidden
from specdec.training.distill_data import DistillData, atomic_save
from specdec.training.schedule import report_losses, warmup_cosine

if TYPE_CHECKING:
    from specdec.training.configs import DistillConfig

LOG_EVERY = 10  # steps between progress-bar loss updates (each one syncs the device)
MUST_MATCH = ("target", "layers", "init_layers", "data", "num_prompts", "response_tokens",
              "max_prompt_tokens", "temperature", "seed", "batch_size", "lr", "warmup_steps", "min_lr_ratio",
              "weight_decay", "grad_clip", "num_val")


@dataclass
class TrainState:
    """Progress: steps done, per-step training KL, ``[step, val KL]`` pairs, seconds over all runs."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    val: list[list[float]] = field(default_factory=list)
    train_seconds: float = 0.0


@lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return tuple(torch.randperm(n, generator=g).tolist())


def batch_indices(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """Example indices (< n) of batch ``step``: consecutive slices of one permutation per epoch."""
    out: list[int] = []
    while len(out) < batch_size:
        epoch, offset = divmod(step * batch_size + len(out), n)
        take = min(batch_size - len(out), n - offset)
        out += _epoch_order(seed, epoch, n)[offset:offset + take]
    return out


def lr_at(step: int, cfg: DistillConfig) -> float:
    """Learning rate of ``step``: linear warm-up, then cosine decay to ``min_lr_ratio * lr``."""
    return warmup_cosine(step, cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)


def make_batch(data: DistillData, indices: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows prompt+response (B, S), and the flat indices (N,) of the positions whose
    next token is a response token."""
    seqs = [data.prompts[i] + data.responses[i] for i in indices]
    s = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)  # (B, S)
    flat: list[int] = []
    for b, i in enumerate(indices):
        p, r = len(data.prompts[i]), len(data.responses[i])
        ids[b, :p + r] = torch.tensor(seqs[b])
        flat += range(b * s + p - 1, b * s + p + r - 1)
    return ids.to(device), torch.tensor(flat, dtype=torch.long).to(device)


def kl_sum(teacher: torch.nn.Module, draft: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor,
           autocast: bool) -> torch.Tensor:
    """Sum over positions ``pos`` of KL(teacher || draft) between next-token distributions."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        with torch.no_grad():
            th = dense_hidden(teacher, ids).flatten(0, 1)[pos]  # (N, hidden)
            t_logp = torch.log_softmax(teacher.compute_logits(th), dim=-1)  # (N, V)
        dh = dense_hidden(draft, ids).flatten(0, 1)[pos]  # (N, hidden)
        d_logp = torch.log_softmax(draft.compute_logits(dh), dim=-1)  # (N, V)
    return F.kl_div(d_logp, t_logp, log_target=True, reduction="sum")


def evaluate(cfg: DistillConfig, teacher: LoadedModel, draft: LoadedModel, data: DistillData,
             indices: list[int]) -> float:
    """Mean KL per response token over the examples ``indices`` (NaN when there are none)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(indices), cfg.batch_size):
            ids, pos = make_batch(data, indices[i:i + cfg.batch_size], cfg.device)
            total += float(kl_sum(teacher.model, draft.model, ids, pos, cfg.autocast))
            count += pos.numel()
    return total / count if count else float("nan")


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def save_checkpoint(path: Path, cfg: DistillConfig, draft: LoadedModel, opt, state: TrainState) -> None:
    """Atomically write trained weights, optimizer, RNG states and ``state`` to ``path``."""
    config = {**asdict(cfg), "num_val": cfg.num_val}
    atomic_save({"config": config, "trained": trained_state(draft.model), "optimizer": opt.state_dict(),
                 "rng": _rng_state(), "state": asdict(state)}, path)


def load_checkpoint(path: Path, cfg: DistillConfig, draft: LoadedModel, opt) -> TrainState:
    """Restore ``path`` into ``draft`` and ``opt``; the options that shape training must match."""
    ckpt = torch.load(path, weights_only=False, map_location="cpu")
    old = ckpt["config"]
    asked = {k: getattr(cfg, k) for k in MUST_MATCH}
    diff = {k: (old.get(k), v) for k, v in asked.items() if old.get(k) != v}
    if diff:
        raise ValueError(f"cannot resume {path}: options differ (checkpoint, asked): {diff}")
    if old["steps"] != cfg.steps:
        print(f"distill: resuming with steps={cfg.steps} (checkpoint planned {old['steps']}): the learning-"
              "rate schedule changes, so the result differs from one uninterrupted run")
    with torch.no_grad():
        for name, p in draft.model.named_parameters():
            if name in ckpt["trained"]:
                p.copy_(ckpt["trained"][name])
    opt.load_state_dict(ckpt["optimizer"])
    _set_rng_state(ckpt["rng"])
    return TrainState(**ckpt["state"])


def train(cfg: DistillConfig, teacher: LoadedModel, draft: LoadedModel, data: DistillData,
          num_train: int) -> TrainState:
    """Train ``draft`` towards ``teacher`` up to ``stop_after`` (else ``steps``).

    Examples ``[0, num_train)`` are trained on, the rest give the validation KL (at step 0, at
    every checkpoint and at the end). Checkpoints go to ``cfg.out/ckpt.pt``.
    """
    from tqdm.auto import tqdm

    ckpt = Path(cfg.out) / "ckpt.pt"
    params = [p for p in draft.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    state = TrainState()
    if cfg.resume and ckpt.is_file():
        state = load_checkpoint(ckpt, cfg, draft, opt)
    elif cfg.resume:
        print(f"distill: --resume but {ckpt} does not exist; training from step 0")
    elif ckpt.is_file():
        print(f"distill: training from step 0; {ckpt} will be overwritten (--resume continues it)")
    val_idx = list(range(num_train, len(data.prompts)))
    if val_idx and not state.val:
        state.val.append([0, evaluate(cfg, teacher, draft, data, val_idx)])
    end, t0, base, pending = cfg.stop_after or cfg.steps, time.perf_counter(), state.train_seconds, []
    with tqdm(total=cfg.steps, initial=state.step, desc="distill", unit="step") as bar:
        while state.step < end:
            for g in opt.param_groups:
                g["lr"] = lr_at(state.step, cfg)
            order = batch_indices(state.step, num_train, cfg.batch_size, cfg.seed)
            ids, pos = make_batch(data, order, cfg.device)
            loss = kl_sum(teacher.model, draft.model, ids, pos, cfg.autocast) / pos.numel()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            pending.append(loss.detach())
            state.step += 1
            saving = state.step % cfg.ckpt_every == 0 or state.step == end
            if saving or state.step % LOG_EVERY == 0:
                report_losses(state.losses, pending, bar, "kl", LOG_EVERY)
            if saving:
                if val_idx:
                    state.val.append([state.step, evaluate(cfg, teacher, draft, data, val_idx)])
                state.train_seconds = base + time.perf_counter() - t0
                save_checkpoint(ckpt, cfg, draft, opt, state)
    return state
