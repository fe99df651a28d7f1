"""Our Llama-family models, run through ModelRunner on a paged KVPool, match transformers' logits.

Each check runs a packed batch of rows of different lengths, including a row that continues
from its cached prefix (chunked prefill: the first chunk in one forward, the rest in the next)
and compares every position's logits with a full transformers forward of the same tokens.
"""

from __future__ import annotations

import random

import pytest
import torch
from specdec.kvcache.allocator import BlockAllocator
from specdec.kvcache.block_table import BlockTables
from specdec.kvcache.pool import KVPool, KVSpec
from specdec.scheduler.request import Request

from specdec.attention.torch_backend import TorchAttentionBackend
from specdec.loading.registry import load_model
from specdec.runner import ModelRunner, RowInput
from specdec.sampling_params import SamplingParams
from specdec.tree import DraftTree

pytestmark = pytest.mark.usefixtures("single_thread")
TOL_TINY = 1e-4
TOL_SMOLLM2 = 5e-4


class PagedHarness:
    """A KV pool holding a decoy model (pool model 0, other shape) and the model under test (model 1),
    so the model's layer views start at a non-zero offset inside each block and blocks are strided."""

    def __init__(self, loaded, block_size: int = 4, num_blocks: int = 96, seed: int = 0) -> None:
        cfg = loaded.config
        specs = [KVSpec(1, 3, 8), KVSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)]
        self.model = loaded.model
        self.pool = KVPool(specs, block_size, num_blocks=num_blocks)
        self.tables = BlockTables(8, num_blocks)
        self.alloc = BlockAllocator(num_blocks)
        # hand out physical blocks in a shuffled order so logical and physical order differ
        self.free = self.alloc.allocate(num_blocks)
        random.Random(seed).shuffle(self.free)
        self.runner = ModelRunner(self.pool, self.tables, TorchAttentionBackend(), "cpu")
        self.block_size = block_size

    def request(self, rid: str, tokens: list[int], capacity: int) -> Request:
        req = Request(rid, list(tokens), SamplingParams())
        n = -(-capacity // self.block_size)
        req.blocks, self.free = self.free[:n], self.free[n:]
        req.bt_row = self.tables.acquire_row()
        return req

    def run(self, rows: list[RowInput]) -> list[torch.Tensor]:
        return self.runner.run(1, self.model, rows)


def causal_row(req: Request, start: int, end: int) -> RowInput:
    """Queries for tokens[start:end] with tokens[:start] already cached."""
    return RowInput(req, req.tokens[start:end], list(range(start, end)), start, end, want_logits="all")


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()  # (len, V)


def load_hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def check_packed_batch(loaded, hf_model, vocab: int, tol: float) -> None:
    """Two forwards over packed rows: fresh rows, a chunked row (first chunk, then the rest)."""
    g = torch.Generator().manual_seed(1)
    seqs = {name: torch.randint(0, vocab, (n,), generator=g).tolist()
            for name, n in (("a", 13), ("b", 29), ("c", 5), ("d", 21))}
    h = PagedHarness(loaded)
    reqs = {name: h.request(name, s, len(s)) for name, s in seqs.items()}
    # forward 1: a (whole), b (first chunk of 10), c (whole)
    out1 = h.run([causal_row(reqs["a"], 0, 13), causal_row(reqs["b"], 0, 10), causal_row(reqs["c"], 0, 5)])
    # forward 2: d (whole) packed with b's continuation from its cached 10-token prefix
    out2 = h.run([causal_row(reqs["d"], 0, 21), causal_row(reqs["b"], 10, 29)])
    ours = {"a": out1[0], "c": out1[2], "d": out2[0], "b": torch.cat([out1[1], out2[1]])}
    for name, ids in seqs.items():
        ref = hf_logits(hf_model, ids)
        assert ours[name].shape == ref.shape, name
        diff = (ours[name] - ref).abs().max().item()
        assert diff < tol, f"row {name}: max abs diff {diff:.3g} >= {tol}"


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "llama_rope_llama3", "llama_rope_linear"])
def test_tiny_logits_match_transformers(tiny_dirs, name):
    folder = tiny_dirs[name]
    ours, hf = load_model(folder), load_hf(folder)
    # the configs really exercise what they are named for
    if name == "qwen2":
        assert ours.config.attention_bias
        assert hf.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    if name == "mistral":
        assert ours.config.sliding_window == 8
    if name.startswith("llama_rope"):
        assert ours.config.rope_scaling["rope_type"] == name.rsplit("_", 1)[1]
    check_packed_batch(ours, hf, ours.config.vocab_size, TOL_TINY)


@pytest.mark.parametrize("name,field", [
    ("llama_rope_linear", "rope_scaling"), ("llama_rope_llama3", "rope_scaling"),
    ("mistral", "sliding_window"), ("qwen2", "attention_bias")])
def test_feature_under_test_changes_logits(tiny_dirs, name, field):
    """Sanity check of the tests above: without the feature (rope scaling, sliding window, q/k/v bias)
    the logits move well beyond the tolerance, so those comparisons do exercise it."""
    from dataclasses import replace

    from specdec.loading.registry import LoadedModel, build_model

    loaded = load_model(tiny_dirs[name])
    cfg = replace(loaded.config, **{field: False if field == "attention_bias" else None})
    state = {k: v for k, v in loaded.model.state_dict().items()
             if cfg.attention_bias or not k.endswith("_proj.bias")}
    plain = build_model(cfg, state, torch.float32, "cpu")
    ids = list(range(3, 40))
    outs = []
    for m in (loaded.model, plain):
        h = PagedHarness(LoadedModel(loaded.name, m, None, m.config))
        outs.append(h.run([causal_row(h.request("x", ids, len(ids)), 0, len(ids))])[0])
    assert (outs[0] - outs[1]).abs().max().item() > 1e-2


def test_tree_masked_rows_match_transformers(tiny_dirs):
    """A verify-style row (pending token + draft tree through the ancestor mask) and a draft-style
    follow-up that queries only the newest tree level: each node's logits equal a plain forward
    of prompt + its root-to-node path."""
    folder = tiny_dirs["llama"]
    loaded, hf = load_model(folder), load_hf(folder)
    prompt = [5, 17, 99, 3, 250, 42, 7, 7, 130, 64, 11]
    L = len(prompt)
    tokens = [21, 77, 140, 9, 33]
    parents = [-1, -1, 0, 0, 1]  # two children of the root, two under node 0, one under node 1
    tree = DraftTree.from_parents(tokens, parents)
    h = PagedHarness(loaded)
    req = h.request("t", prompt, L + len(tokens) + 2)
    other = h.request("o", [8, 6, 4, 2, 1, 3, 5], 8)
    h.run([causal_row(req, 0, L - 1)])  # KV of prompt[:-1]; the last prompt token is pending
    # first three verify tokens (root, node 0, node 1) in one forward with a causal row packed in
    masks = tree.verify_tree_mask().tolist()
    depth = tree.depth.tolist()
    pos = [L - 1] + [L + d for d in depth]
    row = RowInput(req, [prompt[-1]] + tokens[:2], pos[:3], L - 1, L + 2, masks[:3], want_logits="all")
    out = h.run([row, causal_row(other, 0, 7)])
    # then nodes 2..4, reading the already-written root/node 0/node 1 KV (queries < region)
    row2 = RowInput(req, tokens[2:], pos[3:], L - 1, L + len(tokens), masks[3:], want_logits="all")
    out2 = h.run([row2])
    ours = torch.cat([out[0], out2[0]])  # (1 + N, V): root, node 0 .. node 4
    paths = [[]]
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.insert(0, tokens[j])
            j = parents[j]
        paths.append(path)
    for i, path in enumerate(paths):
        ref = hf_logits(hf, prompt + path)[-1]
        diff = (ours[i] - ref).abs().max().item()
        assert diff < TOL_TINY, f"verify token {i} (path {path}): max abs diff {diff:.3g}"
    ref_other = hf_logits(hf, [8, 6, 4, 2, 1, 3, 5])
    assert (out[1] - ref_other).abs().max().item() < TOL_TINY


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "llama_rope_llama3"])
def test_tiny_engine_greedy_matches_transformers_generate(tiny_dirs, name):
    """End to end on the tiny checkpoints: the engine's greedy tokens equal transformers generate()."""
    from specdec.engine import SpecConfig, SpecEngine

    folder = tiny_dirs[name]
    ours, hf = load_model(folder), load_hf(folder)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (4, 19, 33)]
    eng = SpecEngine(None, ours, SpecConfig(num_blocks=64, block_size=8))
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=20))  # both sides stop at EOS
    for prompt, out in zip(prompts, outs, strict=True):
        x = torch.tensor([prompt])
        with torch.inference_mode():
            y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=20,
                            pad_token_id=0, temperature=None, top_p=None, top_k=None)
        assert out.token_ids == y[0, len(prompt):].tolist()
    assert eng.all_blocks_free()


# ---------------------------------------------------------------- SmolLM2-135M


def _long_prompt(tok, n: int) -> list[int]:
    text = ("The history of astronomy spans thousands of years. Early observers tracked the motions of the "
            "Sun, the Moon and the planets, built calendars, and predicted eclipses. ") * 20
    ids = tok.encode(text)
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2, smollm2_hf):
    ids = _long_prompt(smollm2.tokenizer, 200)
    h = PagedHarness(smollm2, block_size=16, num_blocks=32)
    req = h.request("s", ids, len(ids))
    short = h.request("short", ids[50:87], 37)
    first = h.run([causal_row(req, 0, 120), causal_row(short, 0, 37)])
    rest = h.run([causal_row(req, 120, 200)])
    ours = torch.cat([first[0], rest[0]])
    ref = hf_logits(smollm2_hf, ids)
    diff = (ours - ref).abs().max().item()
    assert diff < TOL_SMOLLM2, f"max abs diff {diff:.3g}"
    diff_short = (first[1] - hf_logits(smollm2_hf, ids[50:87])).abs().max().item()
    assert diff_short < TOL_SMOLLM2
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
