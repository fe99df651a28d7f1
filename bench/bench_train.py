"""pytest-benchmark entries of the draft's training loss: one unrolled step's loss through the frozen LM head, scored
chunk by chunk by the fused kernel with its gradient made in the forward (``training.linear_kl.linear_kl``, what
training runs) against scoring the whole logits with autograd through ``log_softmax`` (how it was scored before),
forward and backward.

Run: pytest bench/bench_train.py --benchmark-only. CUDA: 16,384 scored rows, SmolLM2-135M's width (576) and the
shipped draft's vocabulary (24,576), bf16 autocast, half the loss at T = 0.7 (the training round's mix); the peak
memory of each goes into the entry's extra info. CPU: small shapes (the torch reference).
"""

import pytest
import torch

from specdec.training.linear_kl import Teacher, linear_kl

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TEMP, WEIGHT = 0.7, 0.5


def _case():
    n, h, v = (16384, 576, 24576) if CUDA else (512, 64, 2048)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    head = torch.nn.Linear(h, v, bias=False, device=DEVICE).requires_grad_(False)
    x = torch.randn(n, h, device=DEVICE, generator=g).requires_grad_(True)
    t_logp = torch.log_softmax(3 * torch.randn(n, v, device=DEVICE, generator=g), -1)
    return head, x, t_logp, torch.full((n,), 1.0 / n, device=DEVICE)


def _whole(head, x, t_logp, w):
    logits = head(x).float()
    logp, logp_t = torch.log_softmax(logits, -1), torch.log_softmax(logits / TEMP, -1)
    tt = torch.log_softmax(t_logp / TEMP, -1)
    kl = (t_logp.exp() * (t_logp - logp)).sum(-1)
    kl_t = (tt.exp() * (tt - logp_t)).sum(-1)
    return (((1 - WEIGHT) * kl + WEIGHT * kl_t) * w).sum()


@pytest.mark.parametrize("impl", ["fused", "whole"])
def test_train_loss(benchmark, impl):
    head, x, t_logp, w = _case()
    teacher = Teacher.of(t_logp, TEMP)
    sync = torch.cuda.synchronize if CUDA else (lambda: None)

    def step():
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=CUDA):
            loss = linear_kl(x, head, teacher, w, TEMP, WEIGHT)[0] if impl == "fused" else _whole(head, x, t_logp, w)
        loss.backward()
        x.grad = None
        sync()

    step()  # warm-up (the kernel's compile)
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    benchmark(step)
    if CUDA:
        benchmark.extra_info["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
