"""``specdec.graphs.graph_constant``: cached read-only tensors that a CUDA graph read during its capture are never
evicted (the graph replays their addresses). The capture is simulated on the CPU; the GPU test that churns the
real caches under captured graphs is ``test_fused_step.test_gpu_captured_graphs_outlive_their_constant_caches``."""

from __future__ import annotations

import torch

import specdec.graphs as gc_mod
from specdec.graphs import graph_constant
from specdec.lookahead_ops import causal_masks
from specdec.tree_writer import _ancestry_start


def _counted(maxsize: int):
    made = []

    @graph_constant(maxsize=maxsize)
    def const(n: int) -> torch.Tensor:
        made.append(n)
        return torch.full((n,), n)

    return const, made


def test_an_entry_returned_during_a_capture_survives_eviction(monkeypatch):
    const, made = _counted(2)
    monkeypatch.setattr(gc_mod, "capturing", lambda: True)
    read_by_graph = const(5)
    monkeypatch.setattr(gc_mod, "capturing", lambda: False)
    plain = const(6)
    assert const(6) is plain and made == [5, 6]  # cached as usual
    for n in range(7, 12):  # five more shapes through a cache of two: 5 and 6 leave the LRU
        const(n)
    assert const(5) is read_by_graph  # the very tensor, so its address is still the graph's
    assert const(6) is not plain and made.count(6) == 2  # made again: nothing pinned it
    assert list(const.held) == [(5,)]


def test_an_entry_cached_before_the_capture_is_held_when_the_capture_reads_it(monkeypatch):
    """``capture_graph`` runs the forward once before capturing it, so the entry usually exists already."""
    const, made = _counted(1)
    warm = const(3)
    monkeypatch.setattr(gc_mod, "capturing", lambda: True)
    assert const(3) is warm
    monkeypatch.setattr(gc_mod, "capturing", lambda: False)
    const(4)
    assert const(3) is warm and made == [3, 4]


def test_the_caches_that_captured_graphs_read_are_graph_constants(monkeypatch):
    """The tree writer's ``ancestry`` and ``advance``'s causal masks run inside captured graphs (a static tree's
    node offsets are made outside them: ``AdvanceGraphs`` keeps those)."""
    monkeypatch.setattr(gc_mod, "capturing", lambda: True)
    dev = torch.device("cpu")
    got = [_ancestry_start(3, 4, dev), causal_masks(5, dev)]
    monkeypatch.setattr(gc_mod, "capturing", lambda: False)
    for fn, args, value in zip((_ancestry_start, causal_masks), ((3, 4, dev), (5, dev)), got):
        assert fn.held[args] is value
        fn.cache_clear()
        assert fn(*args) is value
