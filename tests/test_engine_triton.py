"""The engine on the Triton backend (interpreted on CPU, float32) equals target-only greedy output."""

import pytest
import torch

from specdec import SamplingParams, SpecConfig, SpecEngine, load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    folder = tmp_path_factory.mktemp("tiny_triton")
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return load_model(folder)


# each tree once with the packed (eager) steps or the padded ones, the n-gram chain both ways
@pytest.mark.parametrize("tree,draft,graphs", [("chain:3", "self", False), ("topk:2x2", "self", True),
                                               ("dynamic:8", "self", False), ("chain:3", "ngram", False),
                                               ("chain:3", "ngram", True)])
def test_triton_backend_spec_equals_target_only(tiny, tree, draft, graphs):
    """Eager packed rows and the padded static-buffer step (graphs=True: captured on CUDA)."""
    prompts = [[int(t) for t in torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (3, 7, 12)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = load_model(tiny.name, device=device) if device == "cuda" else tiny
    base = SpecConfig(prefix_cache=False, num_blocks=128, block_size=4, device=device, attention_backend="torch")
    ref = SpecEngine(None, tiny, base).generate(prompts, params)
    cfg = SpecConfig(tree=tree, prefix_cache=False, num_blocks=128, block_size=4, attention_backend="triton",
                     device=device, cuda_graphs=graphs, max_batch_size=4, adaptive=False)  # full trees: MAL below
    engine = SpecEngine(tiny if draft == "self" else draft, tiny, cfg)
    assert engine.runner.backend.name == "triton"
    assert (engine.runner.graphs is not None) == graphs
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    if draft == "self":
        assert all(o.stats.mean_accepted_length > 2 for o in outs)
    assert engine.all_blocks_free()
