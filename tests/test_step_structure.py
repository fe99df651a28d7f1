"""The step's structure (../shared/DESIGN.md, "One request's journey"): no proposer runs the target model, and one
overlap mechanism (``specdec.pipeline``) serves every proposer.

The proposers run their padded (graph) steps eagerly on the CPU with tiny random models (``cuda_graphs=True``),
fused and pipelined where the plan allows, greedy and sampled rows together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from specdec.engine import SpecConfig, SpecEngine
from specdec.graphs import GraphRunner
from specdec.loading.registry import LoadedModel
from specdec.models.eagle import EagleShape, default_aux_layers, eagle_from_target
from specdec.pipeline import StepPipeline
from specdec.runner import ModelRunner
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[1]
# what launches or queues a target forward: the verifier and its fused / queued launches
TARGET_SIDE = {"specdec.verifier", "specdec.pipeline"}
TARGET_NAMES = {"Verifier", "FusedVerify", "StepPipeline", "verify_proposal", "launch_queued", "launch_draft",
                "relaunch"}


def _proposer_sources() -> list[Path]:
    return sorted((ROOT / "specdec" / "drafters").glob("*.py"))


def test_no_proposer_module_reaches_the_verifier():
    """No module under ``specdec/drafters`` imports the verifier or the pipeline's step launcher, or names the calls
    that launch a verify (statically, imports inside functions included; ``HostUpload`` is a plain upload helper)."""
    bad = []
    for path in _proposer_sources():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in TARGET_SIDE:
                names = {a.name for a in node.names}
                if names - {"HostUpload", "HostRead"}:
                    bad.append((path.name, node.module, sorted(names)))
            elif isinstance(node, ast.Import):
                bad += [(path.name, a.name) for a in node.names if a.name in TARGET_SIDE]
            elif isinstance(node, ast.Attribute) and node.attr in TARGET_NAMES:
                bad.append((path.name, node.attr))
            elif isinstance(node, ast.Name) and node.id in TARGET_NAMES:
                bad.append((path.name, node.id))
    assert bad == []


@pytest.fixture(scope="module")
def tiny_eagle(tiny_target):
    """An untrained EAGLE draft on the tiny target."""
    shape = EagleShape(default_aux_layers(tiny_target.config.num_layers), 256)
    model = eagle_from_target(tiny_target.model, shape, torch.arange(256), seed=2).eval().requires_grad_(False)
    return LoadedModel("eagle", model, None, model.config)


def _watch_target_forwards(monkeypatch) -> list:
    """Record ("target", where) for every target-model forward (pool model 0, eager or graphed) and mark which of
    them ran while a proposer's ``propose`` was on the stack."""
    calls, inside = [], [0]

    def wrap(cls, name, model_of):
        original = getattr(cls, name)

        def watched(self, *args, **kwargs):
            if model_of(args) == 0:
                calls.append("in propose" if inside[0] else "outside")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, watched)

    for name in ("forward", "run"):
        wrap(ModelRunner, name, lambda args: args[0])
    wrap(GraphRunner, "replay", lambda args: args[0][0])
    return calls, inside


@pytest.mark.parametrize("kind", ["none", "ngram", "model", "eagle"])
def test_no_proposer_runs_the_target_model(tiny_target, tiny_draft, tiny_eagle, monkeypatch, kind):
    """Every proposer, padded steps fused and pipelined where the plan allows, greedy and sampled rows: no target
    forward runs inside ``propose`` (the verifier launches each verify, a queued one included), and the target does
    run (the watch is not blind). Pipelined engines step through the one ``StepPipeline``."""
    draft = {"none": None, "ngram": "ngram", "model": tiny_draft, "eagle": tiny_eagle}[kind]
    tree = {"none": "auto", "ngram": "chain:3", "model": "chain:3", "eagle": "dynamic:8"}[kind]
    pipeline = kind != "model"  # (a Llama draft model is never pipelined)
    cfg = SpecConfig(tree=tree, num_blocks=256, block_size=8, max_batch_size=4, cuda_graphs=True, adaptive=False,
                     pipeline=pipeline, ngram_device=kind == "ngram" or None)
    eng = SpecEngine(draft, tiny_target, cfg)
    assert eng.plan.pipeline == pipeline and isinstance(eng.pipeline, StepPipeline) == pipeline
    assert eng.proposer is (eng.pipeline if pipeline else eng.drafter)
    calls, inside = _watch_target_forwards(monkeypatch)
    propose = eng.drafter.propose

    def marked(rows):
        inside[0] += 1
        try:
            return propose(rows)
        finally:
            inside[0] -= 1

    eng.drafter.propose = marked
    prompts = [[5, 17, 99, 23, 4, 42, 8, 77] * 2, [9, 3, 4, 9, 3, 4, 11], [7, 7, 8, 9] * 3]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=9, ignore_eos=True, temperature=0.8, seed=3),
              SamplingParams(max_new_tokens=14, ignore_eos=True)]
    outs = eng.generate(prompts, params)
    assert [o.error for o in outs] == [None] * 3
    assert eng.generate(prompts[::2], params[::2])  # greedy only: queued steps where pipelined
    assert "outside" in calls and "in propose" not in calls
    if kind in ("none", "ngram", "eagle"):
        assert eng.pipeline.adopted > 0
    if kind == "eagle":
        assert eng.drafter.paths["fused"] > 0
    assert eng.all_blocks_free()
