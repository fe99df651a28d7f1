"""Ops per step of the sampled rule (``specdec.sampled_rule.rule``) on the CPU, a stand-in for its graph's kernels.

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/sampled_rule_ops.py [VOCAB]

Batch 16, every row sampled (temperature 0.7, top-p 0.9 as the H200 measurement of bench/RESULTS.md session 10,
and plain temperature 0.7), n-gram-like chains filling the bucket: Q = 1 (empty trees: target-only decoding) and
Q = 9 (8-node chains). One eager run of ``rule`` counts every aten op that computes something (views, allocations
and host reads left out), as ``cpu_program_launches.py`` does; the count does not depend on the vocabulary size.
A GPU run may split some ops (torch.sort, cumsum) into more than one kernel.
"""

from __future__ import annotations

import collections
import sys
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specdec.sampled_rule import rule, step_array
from specdec.sampling_params import SamplingParams
from specdec.tree import DraftTree
from specdec.uniform_stream import UniformStream

FREE = {"view", "_unsafe_view", "detach", "alias", "lift_fresh", "empty", "empty_like", "empty_strided", "item",
        "is_nonzero", "_local_scalar_dense"}
BATCH = 16


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in FREE:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def count(q: int, top_p: float, vocab: int, chains: bool) -> collections.Counter:
    """Ops of one eager ``rule`` call for BATCH sampled rows with (q - 1)-node chains; ``chains``: the loop-free
    rule (else the trial loop, as trees with siblings take)."""
    params = SamplingParams(temperature=0.7, top_p=top_p, seed=1)
    rows = [SimpleNamespace(params=params, stream=UniformStream(i)) for i in range(BATCH)]
    trees = [DraftTree.chain(list(range(i, i + q - 1))) if q > 1 else DraftTree.empty() for i in range(BATCH)]
    sampled = list(range(BATCH))
    host = step_array(rows, trees, sampled, BATCH, q)
    inputs = torch.from_numpy(host)
    logits = torch.randn(BATCH * q, vocab, generator=torch.Generator().manual_seed(q))
    accept = torch.zeros(BATCH, q + 3, dtype=torch.int64)
    with _Ops() as ops:
        rule(inputs, logits, accept, top_p < 1.0, chains)
    return ops.counts


def main() -> None:
    vocab = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    for q in (1, 9):
        for top_p in (0.9, 1.0):
            for chains in (False, True):
                counts = count(q, top_p, vocab, chains)
                print(f"Q={q} top_p={top_p} {'chain rule' if chains else 'trial loop'}: {sum(counts.values())} ops: "
                      f"{dict(counts.most_common())}", flush=True)


if __name__ == "__main__":
    main()
