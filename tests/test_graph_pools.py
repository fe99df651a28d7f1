"""Graph memory pools (``GraphRunner.capture``), checked on the CPU with stand-in graphs.

Graphs captured into one CUDA memory pool share the memory of their intermediates: a replay may overwrite the
outputs of a graph of its pool captured after it. A pipelined step is written from verify K's outputs after the
next step's prefill pieces ran (rows whose prefill ended join it), so those must not share a pool. Here every
captured graph is a stand-in that runs its forward again at each replay into the same output tensors, and first
poisons the outputs of the graphs of its pool captured after it (NaN, or -77777 for integers): the worst the
allocator may do. An output read after such a replay is then visibly wrong.
"""

from __future__ import annotations

import pytest
from graph_standins import install_standin_graphs
from test_eagle import setup  # noqa: F401 - the trained tiny draft, a fixture
from test_lookahead import PARAMS, PROMPTS, tiny  # noqa: F401 - the engine fixture (CPU here)

from specdec.engine import SpecConfig, SpecEngine

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def poisoning(monkeypatch):
    """Stand-in graphs that poison their pool's later outputs (``graph_standins.install_standin_graphs``: returns the
    pools, id -> graphs in capture order)."""
    return install_standin_graphs(monkeypatch)


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
