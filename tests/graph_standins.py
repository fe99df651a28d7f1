"""Stand-in CUDA graphs for the CPU: every graph a ``GraphRunner`` (and the device draft program) would capture is
an object that runs its forward again at each replay into the same output tensors, and first poisons the outputs of
the graphs of its memory pool captured after it (NaN, or -77777 for integers): the worst the allocator may do. Used
by ``test_graph_pools.poisoning`` (a fixture) and by ``bench/cpu_step_ops.py``."""

from __future__ import annotations

import functools
import itertools

import torch


def _made_by(out, again) -> list[torch.Tensor]:
    """The tensors of ``out`` that its forward allocated (not persistent buffers it returns): those whose storage
    differs from a second run's, made while the first was alive."""
    if isinstance(out, torch.Tensor):
        return [out] if out.data_ptr() != again.data_ptr() else []
    if isinstance(out, (tuple, list)):
        return [t for a, b in zip(out, again) for t in _made_by(a, b)]
    return []


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


class _PoisoningGraph:
    def __init__(self, forward, pool, pools: dict) -> None:
        again = forward()
        self.out = forward()
        self.made = _made_by(self.out, again)
        self.forward, self.others = forward, pools.setdefault(pool, [])
        self.others.append(self)

    def replay(self) -> None:
        with torch.inference_mode():
            for later in self.others[self.others.index(self) + 1:]:
                for t in later.made:
                    t.fill_(float("nan") if t.dtype.is_floating_point else -77777)
            _copy_into(self.out, self.forward())


def install_standin_graphs(monkeypatch) -> dict:
    """Stand-in graphs that poison their pool's later outputs, installed with ``monkeypatch`` (returns the pools:
    id -> graphs in capture order); ``GraphRunner.capture`` runs as on CUDA, each ``torch.cuda.graph_pool_handle()``
    a new pool."""
    import specdec.drafters.eagle_device as ed
    import specdec.graphs as cg

    pools: dict = {}
    ids = itertools.count()

    def capture_graph(forward, pool, device):
        graph = _PoisoningGraph(forward, next(ids) if pool is None else pool, pools)  # (None: a private pool)
        return graph, graph.out

    class _Cuda:  # what ``GraphRunner.capture`` checks before it captures
        type = "cuda"

    real = cg.GraphRunner.capture

    def capture(self):
        device, self.device = self.device, _Cuda()
        try:
            return real(self)
        finally:
            self.device = device

    def program_capture(self, pool=None):  # ``DeviceDraftProgram.capture``'s loop, into ``pool``
        for b in sorted(self.batch_buckets, reverse=True):
            self.inputs.clear(b, self.q)
            for levels, width in self.variants:
                for sampled in (False, True) if levels else (False,):
                    key = (b, sampled, levels, width)
                    self.graphs[key] = capture_graph(functools.partial(self._program, *key), pool, None)
        return len(self.graphs), 0.0

    monkeypatch.setattr(cg, "capture_graph", capture_graph)
    monkeypatch.setattr(ed, "capture_graph", capture_graph)
    monkeypatch.setattr(cg.GraphRunner, "capture", capture)
    monkeypatch.setattr(ed.DeviceDraftProgram, "capture", program_capture)
    monkeypatch.setattr(cg.torch.cuda, "graph_pool_handle", lambda: next(ids))
    monkeypatch.setattr(cg.torch.cuda, "memory_reserved", lambda *a: 0)
    monkeypatch.setattr(cg.torch.cuda, "synchronize", lambda *a: None)
    return pools
