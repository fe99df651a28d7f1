"""How many operators each kind of engine step launches outside graphs, on the CPU: the host's share of a step.

On CUDA a step is a few graph replays plus whatever the host launches eagerly around them (copies, indexing, small
kernels); each eager launch costs host time whatever its size, and a pipelined step hides only so much of it. Which
operators a step launches eagerly does not depend on the device, so this counts them on the CPU: every graph is a
stand-in (``tests/graph_standins.py``: its forward runs again at each replay, and is not counted), every part that
captures graphs on first use on CUDA does so here too, and the torch dispatcher counts what runs outside replays.
The tiny random target and EAGLE draft of ``cpu_pipeline_adoption.py`` (2 layers, 512-token vocabulary), 40 prompts
of 8-200 tokens at 8 rows, requests ending at different steps, pipelined, greedy and T = 0.7.

    python -P bench/cpu_step_ops.py [none|ngram|eagle ...]

prints, per proposer and temperature, for the steps that ran a prefill and the others: how many, the median count
of operators launched outside replays (views and slices included: each is a dispatcher call on the host) and of
replays, and the most frequent operators of the median step.
"""

from __future__ import annotations

import collections
import statistics
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent / "tests")]
import graph_standins  # noqa: E402 - (neither folder is a package)
from cpu_pipeline_adoption import tiny_engine, tiny_models, tiny_prompts  # noqa: E402


class _Count(TorchDispatchMode):
    """Counts the operators dispatched while no stand-in replay runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.replays = self.depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth == 0:
            self.ops[str(func.overloadpacket).split(".")[-1]] += 1
        return func(*args, **(kwargs or {}))


def _capture_everything(eng) -> None:
    """The parts that capture graphs on first use on CUDA do so with the stand-ins too."""
    hook = eng.pipeline.hook
    for part in (hook, getattr(hook, "decode", None)):
        if part is not None and hasattr(part, "advance"):
            part.advance.capture = True
    if eng.verifier.fused is not None:
        eng.verifier.fused.writer.capture = True
    eng.verifier.sampled_rule.capture = True
    if getattr(eng.verifier.followup, "capture", None) is not None:
        eng.verifier.followup.capture = True


def main(kinds: list[str]) -> None:
    from specdec import SamplingParams

    torch.set_num_threads(1)
    target, eagle = tiny_models()
    prompts = tiny_prompts(40)
    for kind in kinds:
        for temperature in (0.0, 0.7):
            params = [SamplingParams(max_new_tokens=16 + (i * 7) % 24, ignore_eos=True, temperature=temperature,
                                     seed=i) for i in range(len(prompts))]
            with pytest.MonkeyPatch.context() as mp:
                graph_standins.install_standin_graphs(mp)
                count = _Count()
                replay = graph_standins._PoisoningGraph.replay

                def counted_replay(self, replay=replay, count=count):
                    count.depth += 1
                    count.replays += 1
                    try:
                        replay(self)
                    finally:
                        count.depth -= 1

                mp.setattr(graph_standins._PoisoningGraph, "replay", counted_replay)
                eng = tiny_engine(kind, target, eagle, 8)
                _capture_everything(eng)
                by_kind, step = collections.defaultdict(list), eng.step

                def counted_step(step=step, by_kind=by_kind, count=count, eng=eng):
                    count.ops, count.replays = collections.Counter(), 0
                    with count:
                        out = step()
                    kind = "prefill" if eng.drafter.step_prefilled else "decode"
                    by_kind[kind].append((sum(count.ops.values()), count.replays, count.ops))
                    return out

                eng.step = counted_step
                eng.generate(prompts, params)
            for step_kind, rows in sorted(by_kind.items(), reverse=True):
                median = sorted(rows, key=lambda r: r[0])[len(rows) // 2]
                top = ", ".join(f"{name} {n}" for name, n in median[2].most_common(8))
                print(f"step_ops {kind} T={temperature} {step_kind}: {len(rows)} steps, median "
                      f"{statistics.median(r[0] for r in rows):g} operators outside replays, "
                      f"{statistics.median(r[1] for r in rows):g} replays ({top})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["none", "ngram", "eagle"])
