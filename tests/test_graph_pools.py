"""Graph memory pools (``GraphRunner.capture``), checked on the CPU with stand-in graphs.

Graphs captured into one CUDA memory pool share the memory of their intermediates: a replay may overwrite the
outputs of a graph of its pool captured after it. A pipelined step is written from verify K's outputs after the
next step's prefill pieces ran (rows whose prefill ended join it), so those must not share a pool. Here every
captured graph is a stand-in that runs its forward again at each replay into the same output tensors, and first
poisons the outputs of the graphs of its pool captured after it (NaN, or -77777 for integers): the worst the
allocator may do. An output read after such a replay is then visibly wrong.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from test_eagle import setup  # noqa: F401 - the trained tiny draft, a fixture
from test_lookahead import PARAMS, PROMPTS, tiny  # noqa: F401 - the engine fixture (CPU here)

from specdec.engine import SpecConfig, SpecEngine

pytestmark = pytest.mark.usefixtures("single_thread")


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


@pytest.fixture
def poisoning(monkeypatch):
    """Stand-in graphs that poison their pool's later outputs (returns the pools: id -> graphs in capture
    order); ``GraphRunner.capture`` runs as on CUDA, each ``torch.cuda.graph_pool_handle()`` a new pool."""
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


@pytest.mark.parametrize("proposer", ["eagle", "none"])
def test_pipelined_steps_read_no_output_a_prefill_overwrote(tiny, poisoning, proposer):  # noqa: F811
    """Rows joining pipelined steps (two rows for four requests that end at different steps: each later request
    is prefilled while the others decode) with every graph poisoning its pool's later outputs: output equals
    target-only decoding. The verify graphs, the prefill pieces with the draft forwards, and the draft program
    are in pools of their own; the queued-step writer's graphs in private ones."""
    draft, target, want, cfg = tiny
    if cfg["device"] != "cpu":
        pytest.skip("stand-in graphs; on CUDA the real ones run in test_lookahead")
    cfg = {**cfg, "max_batch_size": 2, "admit_min_free": 1}
    eng = SpecEngine(draft if proposer == "eagle" else None, target, SpecConfig(tree="dynamic:16", **cfg))
    eng.pipeline.hook.advance.capture = True  # (the writer as captured graphs, as on CUDA)
    graphs = eng.runner.graphs
    pool_of = {id(g): pool for pool, members in poisoning.items() for g in members}
    verify = {pool_of[id(g)] for key, (g, _) in graphs.graphs.items() if key[0] == 0}
    others = {pool_of[id(g)] for key, (g, _) in graphs.graphs.items() if key[0] != 0}
    assert len(verify) == 1 and others and not verify & others
    assert [o.token_ids for o in eng.generate(PROMPTS[:4], PARAMS)] == want
    assert eng.pipeline.joined > 0 and eng.pipeline.adopted > 0
    assert eng.all_blocks_free()


def test_one_pool_for_every_graph_fails(tiny, poisoning, monkeypatch):  # noqa: F811
    """The negative control: every start-up graph in one pool (as before the pools were split), and the
    pipelined target-only engine whose rows join after a prefill reads a verify outcome a prefill piece
    overwrote: its requests fail or their output differs."""
    import specdec.graphs as cg

    draft, target, want, cfg = tiny
    if cfg["device"] != "cpu":
        pytest.skip("stand-in graphs")
    monkeypatch.setattr(cg.torch.cuda, "graph_pool_handle", lambda: "one")
    cfg = {**cfg, "max_batch_size": 2, "admit_min_free": 1}
    eng = SpecEngine(None, target, SpecConfig(tree="dynamic:16", **cfg))
    eng.pipeline.hook.advance.capture = True
    assert list(poisoning) == ["one"]
    outs = eng.generate(PROMPTS[:4], PARAMS)
    assert [o.token_ids for o in outs] != want
