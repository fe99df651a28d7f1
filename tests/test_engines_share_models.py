"""Several engines built over the same target and EAGLE draft objects (as a benchmark interleaving them
does) each keep giving target-only's greedy output when their runs alternate."""

import pytest
import torch
from test_eagle import PROMPTS, setup  # noqa: F401 - the module's trained tiny draft, a fixture

from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.registry import load_model
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_interleaved_engines_over_shared_models_stay_lossless(setup, device):  # noqa: F811 - the fixture
    """float32; on CUDA with captured graphs, the draft programs and tree graphs of four live engines."""
    root, _, target = setup
    if device == "cuda":
        target = load_model(root / "target", device="cuda")
    draft = load_model(root / "full", target=target, device=device)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    cfg = dict(num_blocks=256, block_size=8, max_batch_size=4, cuda_graphs=True, device=device)
    prompts = PROMPTS * 2
    want = [o.token_ids for o in SpecEngine(None, target, SpecConfig(**cfg)).generate(prompts, params)]
    engines = [SpecEngine(None, target, SpecConfig(**cfg))] + [
        SpecEngine(draft, target, SpecConfig(tree=tree, adaptive=adaptive, **cfg))
        for tree, adaptive in (("topk:2x3", False), ("dynamic:16", False), ("dynamic:16", True))]
    for _ in range(2):  # rounds: each engine in turn, in waves of 4 and then all prompts at once
        for eng in engines:
            waves = [o.token_ids for i in range(0, len(prompts), 4) for o in eng.generate(prompts[i:i + 4], params)]
            assert waves == want
            assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert all(eng.all_blocks_free() for eng in engines)
    assert sum(eng.stats.accepted for eng in engines[1:]) > 0
