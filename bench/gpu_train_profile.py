"""Where a draft training step's time goes: ``specdec distill --kind eagle``'s step (teacher forward, the unrolled
draft steps and their loss, backward, AdamW) timed and profiled on synthetic token rows of the training shape.

    python -P bench/gpu_train_profile.py OUT_DIR MODEL [STEPS]

The target ``MODEL`` loads as the training round loads it (bf16, with bf16 autocast), the draft is a fresh one of the
shipped draft's shape (vocabulary 24,576, the default feature layers) with every own tensor trained, and each step
runs ``eagle_train``'s calls on 32 rows of 1,024 random tokens with every position scored (``batch_tokens`` 32,768, 6
unrolled steps, half the loss at T = 0.7: the settings of the shipped draft's training). Written to OUT_DIR:
``train_profile.json`` (ms per step over STEPS steps after warm-up, and the milliseconds of each phase between
events on the stream: teacher, draft forward and loss, backward, optimiser) and ``train_profile.txt`` (the
profiled steps' top operators by GPU time).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from specdec.loading.registry import load_model
from specdec.models.eagle import EagleShape, default_aux_layers, eagle_from_target
from specdec.training.eagle_unroll import LossMix, teacher_forward, unrolled_loss

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # (the CPU: a quick check of this script, at 2 rows of 64 tokens)
ROWS, LENGTH, UNROLL, DECAY, VOCAB = (32, 1024, 6, 0.8, 24576) if CUDA else (2, 64, 6, 0.8, 24576)
PHASES = ("teacher", "draft+loss", "backward", "optimizer")


def main(out: Path, model: str, steps: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(model, dtype=torch.bfloat16 if CUDA else torch.float32, device=DEVICE)
    shape = EagleShape(default_aux_layers(target.config.num_layers), VOCAB)
    draft = eagle_from_target(target.model, shape, torch.arange(VOCAB), None, torch.float32, 0, trainable=True)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (ROWS, LENGTH), device=DEVICE, generator=g)
    valid = torch.ones(ROWS, LENGTH, dtype=torch.bool, device=DEVICE)
    valid[:, -1] = False

    def step(marks: list | None = None) -> None:
        """One training step; ``marks`` (when given) gets a timing mark at each phase boundary."""
        mark = (lambda: marks.append(_mark())) if marks is not None else (lambda: None)
        mark()
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=CUDA):
            with record_function("teacher"):
                teacher = teacher_forward(target.model, draft, ids)
            mark()
            with record_function("draft+loss"):
                loss = unrolled_loss(draft, teacher, ids, valid, UNROLL, DECAY, LossMix(0.7, 0.5)).loss
        mark()
        opt.zero_grad(set_to_none=True)
        with record_function("backward"):
            loss.backward()
        mark()
        with record_function("optimizer"):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        mark()

    for _ in range(3):  # warm-up
        step()
    sync = torch.cuda.synchronize if CUDA else (lambda: None)
    sync()
    times, phases = [], {name: [] for name in PHASES}
    for _ in range(steps):
        marks: list = []
        t0 = time.perf_counter()
        step(marks)
        sync()
        times.append(time.perf_counter() - t0)
        for name, a, b in zip(PHASES, marks, marks[1:]):
            phases[name].append(_elapsed(a, b))
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * CUDA) as prof:
        for _ in range(3):
            step()
        sync()
    events = prof.key_averages()
    record = {"model": model, "rows": ROWS, "length": LENGTH, "unroll": UNROLL, "steps": steps,
              "ms_per_step": round(1e3 * statistics.median(times), 1),
              "tokens_per_s": round(ROWS * LENGTH / statistics.median(times)),
              "ms_per_step_by_phase": {k: round(1e3 * statistics.median(v), 1) for k, v in phases.items()},
              "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if CUDA else None}
    (out / "train_profile.json").write_text(json.dumps(record, indent=1))
    (out / "train_profile.txt").write_text(events.table(sort_by="device_time_total" if CUDA else "cpu_time_total",
                                                        row_limit=40))
    print(json.dumps(record))


def _mark():
    """A timing mark on the stream (CUDA: an event recorded; else the host clock)."""
    if not CUDA:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed(a, b) -> float:
    return b - a if not CUDA else a.elapsed_time(b) / 1e3


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 10)
