"""Eagle (feature-conditioned) drafts: token files, unrolled training, folders, lossless drafting.

A 4-layer random Llama with a character-level chat tokenizer (``test_distill``) is the target;
ShareGPT is a small fake JSON file in the same format.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_distill import _save_tiny_target

from specdec.cli import main
from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.errors import UnsupportedModelError
from specdec.loading.registry import LoadedModel, build_model, load_model
from specdec.models.eagle import EagleDraft, EagleShape, default_aux_layers, eagle_from_target
from specdec.models.llama import ForwardContext
from specdec.sampling_params import SamplingParams
from specdec.training.configs import EagleTrainConfig
from specdec.training.dense_attention import DenseBatch, DenseCausalBackend
from specdec.training.eagle_data import build_token_file, conversation_messages, coverage, load_token_file, top_vocab
from specdec.training.eagle_train import ROW_MULTIPLE, batch_docs, padded_length
from specdec.training.eagle_unroll import unrolled_mask

pytestmark = pytest.mark.usefixtures("single_thread")

STEPS = 30
WORDS = "the cat dog sat on a mat big red blue runs fast tree house why how what is are".split()
TRAIN_ARGS = ["--kind", "eagle", "--draft-vocab", "40", "--unroll", "3", "--max-len", "96", "--batch-tokens",
              "384", "--steps", str(STEPS), "--lr", "3e-3", "--ckpt-every", "10", "--val-docs", "4",
              "--device", "cpu", "--seed", "1"]


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _fake_sharegpt(path, n: int = 60) -> None:
    rng = random.Random(0)
    convs = []
    for i in range(n):
        turns = [{"from": "gpt", "value": "hello"}] if i % 7 == 3 else []  # a leading reply is dropped
        for _ in range(rng.randint(1, 3)):
            turns += [{"from": "human", "value": _sentence(rng, rng.randint(2, 8))},
                      {"from": "gpt", "value": _sentence(rng, rng.randint(5, 25))}]
        convs.append({"id": str(i), "conversations": turns})
    path.write_text(json.dumps(convs))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    _save_tiny_target(root / "target")
    _fake_sharegpt(root / "sharegpt.json")
    target = load_model(root / "target")
    build_token_file(root / "train.npz", target.tokenizer, "train", 10**6, 96, root / "sharegpt.json", "tiny")
    base = ["distill", "--target", str(root / "target"), "--tokens", str(root / "train.npz"), *TRAIN_ARGS]
    assert main([*base, "--out", str(root / "full")]) == 0
    return root, base, target


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # float32 either way; graphs captured on CUDA


def trained_pair(setup, device: str, params) -> tuple[LoadedModel, LoadedModel, list[list[int]]]:
    """(draft, target, target-only tokens of the first four ``PROMPTS`` under ``params``): the module's trained
    tiny EAGLE draft and its target (``setup``) on ``device``, float32."""
    root, _, _ = setup
    target = load_model(root / "target", device=device)
    draft = load_model(root / "full", target=target, device=device)
    plain = SpecEngine(None, target, SpecConfig(num_blocks=200, block_size=8, device=device, cuda_graphs=False))
    return draft, target, [o.token_ids for o in plain.generate(PROMPTS[:4], params)]


def test_token_file_marks_assistant_turns_of_the_train_split(setup):
    root, _, target = setup
    data = load_token_file(root / "train.npz")
    assert data.meta["split"] == "train" and data.num_docs == 57  # indices 1..59 minus the 3 of index % 20 == 0
    ids, mask = data.doc(0)
    text = "".join(target.tokenizer.decode([int(t)]) for t, m in zip(ids, mask) if m)
    turns = json.loads((root / "sharegpt.json").read_text())[1]["conversations"]
    replies = "".join(t["value"] + "<|im_end|>\n" for t in turns if t["from"] == "gpt")
    assert len(text) > 5 and replies.startswith(text) and len(ids) <= 96
    assert conversation_messages({"conversations": [{"from": "gpt", "value": "x"}]}) is None


def test_vocabulary_and_coverage():
    tokens = np.array([5, 5, 5, 7, 7, 2, 9], dtype=np.uint16)
    assert top_vocab(tokens, 12, 2).tolist() == [5, 7]
    assert top_vocab(tokens, 12, 3).tolist() == [2, 5, 7]  # ties broken by the lower id
    assert coverage(tokens, np.array([5, 7])) == pytest.approx(5 / 7)


def test_unrolled_mask_is_the_tree_attention_of_depth_k():
    m = unrolled_mask(5, 2, "cpu")  # (S, 3S): step-0 keys <= p-2, step-1 key p-1, step-2 key p
    p = 4
    assert m[p, :5].tolist() == [True, True, True, False, False]
    assert m[p, 5:10].tolist() == [False, False, False, True, False]
    assert m[p, 10:].tolist() == [False, False, False, False, True]
    assert m.sum(1).tolist() == [1, 2, 3, 4, 5]


def test_batches_are_a_function_of_seed_and_step():
    lengths = tuple(random.Random(0).randint(5, 90) for _ in range(50))
    first = [batch_docs(s, lengths, 200, 3) for s in range(40)]
    assert first == [batch_docs(s, lengths, 200, 3) for s in range(40)]
    assert all(len(b) * max(lengths[i] for i in b) <= 200 for b in first)
    epoch = []
    for s in range(40):
        epoch += first[s]
        if len(epoch) >= 50:
            break
    assert sorted(epoch) == list(range(50))  # one epoch covers every conversation once


def test_batches_group_conversations_of_similar_length():
    """Most rows of a batch are real tokens, not padding: with a skewed mix of lengths (most conversations short,
    some at max_len), batching that let a long conversation join short ones padded ~3/4 of every row."""
    rng = random.Random(1)
    tokens = [min(1024, int(rng.lognormvariate(5.0, 1.1)) + 8) for _ in range(3000)]
    lengths = tuple(padded_length(n, 1024) for n in tokens)
    assert all(p % ROW_MULTIPLE == 0 or p == 1024 for p in lengths) and all(p >= n for p, n in zip(lengths, tokens))
    steps, real, padded, epoch = 0, 0, 0, []
    while len(epoch) < len(tokens):
        b = batch_docs(steps, lengths, 32768, 0)
        assert len(b) * max(lengths[i] for i in b) <= 32768
        epoch += b
        real += sum(tokens[i] for i in b)
        padded += len(b) * max(lengths[i] for i in b)
        steps += 1
    assert sorted(epoch) == list(range(len(tokens)))
    assert real / padded > 0.75, real / padded


def _ckpt(folder):
    return torch.load(folder / "ckpt.pt", weights_only=False)


def test_training_lowers_the_kl_and_writes_a_small_folder(setup):
    root, _, target = setup
    losses = _ckpt(root / "full")["state"]["losses"]
    assert len(losses) == STEPS and np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses
    meta = json.loads((root / "full" / "specdec_draft.json").read_text())
    assert meta["kind"] == "eagle" and meta["draft_vocab"] == 40 and meta["aux_layers"] == [0, 2, 3]
    rec = meta["training"]
    assert rec["steps"] == STEPS and len(rec["val"][-1]["top1"]) == 3 and rec["data"]["split"] == "train"
    keys = set(load_file(str(root / "full" / "model.safetensors")))
    assert "vocab_ids" in keys and not any(k.startswith(("embed_tokens", "lm_head")) for k in keys)


def test_resumed_run_matches_uninterrupted(setup):
    root, base, _ = setup
    out = root / "resumed"
    assert main([*base, "--out", str(out), "--stop-after", "10"]) == 0
    assert not (out / "model.safetensors").exists()
    assert main([*base, "--out", str(out), "--resume"]) == 0
    full, resumed = _ckpt(root / "full"), _ckpt(out)
    assert resumed["state"]["losses"] == pytest.approx(full["state"]["losses"], abs=1e-6)
    for name, w in full["trained"].items():
        torch.testing.assert_close(resumed["trained"][name], w, rtol=0, atol=1e-6)
    args = [*base, "--out", str(out), "--resume"]
    args[args.index("--unroll") + 1] = "2"
    assert main(args) == 2  # a ValueError naming the differing option


def test_options_of_the_other_kind_are_refused(setup):
    root, base, _ = setup
    assert main([*base, "--out", str(root / "x"), "--num-prompts", "3"]) == 2
    assert main(["distill", "--out", str(root / "y"), "--draft-vocab", "8"]) == 2
    with pytest.raises(ValueError, match="warmup_steps"):
        EagleTrainConfig(out="o", tokens="t", steps=5, warmup_steps=6)
    assert EagleTrainConfig(out="o", tokens="t", steps=5).warmup_steps == 0  # default fits a short run


def test_folder_loads_on_its_target_only(setup):
    root, _, target = setup
    draft = load_model(root / "full", target=target)
    assert isinstance(draft.model, EagleDraft) and draft.config.num_layers == 1
    assert draft.model.embed_tokens.weight.data_ptr() == target.model.model.embed_tokens.weight.data_ptr()
    state = dict(target.model.state_dict())
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * 2
    other = LoadedModel("other", build_model(target.config, state, torch.float32, "cpu"), None, target.config)
    with pytest.raises(UnsupportedModelError, match="embed_tokens"):
        load_model(root / "full", target=other)


PROMPTS = [[{"role": "user", "content": _sentence(random.Random(i), 3 + 4 * i)}] for i in range(5)]


@pytest.mark.parametrize("tree", ["chain:1", "chain:4", "topk:2x3", "dynamic:16"])
def test_greedy_output_equals_target_only(setup, tree):
    root, _, target = setup
    draft = load_model(root / "full", target=target)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    cfg = dict(max_batch_size=5, num_blocks=128, block_size=8)
    plain = SpecEngine(None, target, SpecConfig(**cfg)).generate(PROMPTS, params)
    for prefix_cache in (False, True) if tree == "chain:4" else (True,):
        eng = SpecEngine(draft, target, SpecConfig(tree=tree, prefix_cache=prefix_cache, **cfg))
        spec = eng.generate(PROMPTS + PROMPTS[:2], params)  # repeated prompts hit the prefix cache
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain + plain[:2]]
        assert eng.all_blocks_free()
    assert sum(o.stats.accepted for o in spec) > 0
    attn, mlp = draft.model.layer.self_attn, draft.model.layer.mlp  # the engine fused the draft's projections
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert mlp.gate_proj.weight.data_ptr() == mlp.gate_up_weight.data_ptr()


@pytest.mark.parametrize("tree", ["chain:4", "topk:2x3", "dynamic:16"])
def test_padded_step_eagle_equals_target_only(setup, tree, monkeypatch):
    """With the graph path's padded buffers (on the CPU: eager replay), the verify step returns the target
    features and every draft forward (catch-up and tree levels) goes through the padded buffers; greedy
    output still equals target-only."""
    from specdec.graphs import GraphRunner
    from specdec.step_inputs import PREFILL

    root, _, target = setup
    draft = load_model(root / "full", target=target)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    cfg = dict(max_batch_size=8, num_blocks=128, block_size=8)
    plain = SpecEngine(None, target, SpecConfig(cuda_graphs=False, **cfg)).generate(PROMPTS, params)
    calls = {PREFILL: 0, 0: 0, 1: 0}
    run = GraphRunner.run_packed  # every padded forward (``run`` too) goes through it

    def counting(self, key, *args, **kwargs):
        calls[key[0]] += 1
        out = run(self, key, *args, **kwargs)  # the target's verify and prefill steps return features
        assert (out.features is not None) == (key[0] != 1) and (out.hidden is not None) == (key[0] == 1)
        return out

    monkeypatch.setattr(GraphRunner, "run_packed", counting)
    eng = SpecEngine(draft, target, SpecConfig(tree=tree, cuda_graphs=True, **cfg))
    eng.drafter.device_loop = None  # the level-by-level path (the device programs are tested below)
    spec = eng.generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert calls[0] > 0 and calls[1] > calls[0]  # draft: a catch-up and at least one level per verify
    assert sum(o.stats.accepted for o in spec) > 0
    assert eng.all_blocks_free()


@pytest.mark.parametrize("tree", ["chain:4", "topk:2x3"])
def test_device_tree_loop_proposes_the_host_paths_trees(setup, tree):
    """Static trees of greedy batches are drafted by one device program (catch-up and every level, no host
    read between them); its trees equal the level-by-level host path's, step for step, and the output
    equals target-only."""
    root, _, target = setup
    draft = load_model(root / "full", target=target)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    cfg = dict(tree=tree, max_batch_size=8, num_blocks=128, block_size=8, cuda_graphs=True)
    plain = SpecEngine(None, target, SpecConfig(cuda_graphs=False, **{k: cfg[k] for k in ("num_blocks",
                                                                                       "block_size")}))
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    seen = {}
    for device_loop in (True, False):
        eng = SpecEngine(draft, target, SpecConfig(**cfg))
        assert eng.drafter.device_loop is not None
        if not device_loop:
            eng.drafter.device_loop = None
        trees, verify = [], eng.verifier.verify_proposal

        def spy(rows, prop, verify=verify, trees=trees):  # (a device proposal's trees are known once verified)
            results = verify(rows, prop)
            trees.append([t.host.tokens for t in prop.trees])
            return results

        eng.verifier.verify_proposal = spy
        if device_loop:
            calls = []
            replay = eng.drafter.device_loop.replay  # every program run (queued pipelined steps call it alone)
            eng.drafter.device_loop.replay = lambda *a, replay=replay, calls=calls: calls.append(1) or replay(*a)
        assert [o.token_ids for o in eng.generate(PROMPTS, params)] == want
        assert eng.all_blocks_free()
        seen[device_loop] = trees
    # every step took the device program (a pipelined step queued after a generate's last one is dropped)
    assert len(seen[True]) <= len(calls) <= len(seen[True]) + 1 and calls
    assert seen[True] == seen[False]


@pytest.mark.parametrize("tree, shape", [("dynamic:16", (10, 5, 16)), ("dynamic:12:3x5", (3, 5, 12)),
                                         ("dynamic:24:6x4", (6, 4, 24))])
def test_device_dynamic_tree_equals_target_only(setup, tree, shape):
    """Dynamic trees of greedy batches are grown inside the device program (fixed-shape EAGLE-2 levels, then
    the best nodes): every step takes it, every tree has the shape's node count, parents before children,
    and the output equals target-only; the draft KV region may pass the kept nodes (lookahead)."""
    from specdec.drafters.eagle_dynamic import DeviceDynamicTree

    root, _, target = setup
    draft = load_model(root / "full", target=target)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    cfg = dict(num_blocks=160, block_size=8)
    want = [o.token_ids for o in SpecEngine(None, target, SpecConfig(**cfg)).generate(PROMPTS, params)]
    eng = SpecEngine(draft, target, SpecConfig(tree=tree, max_batch_size=8, cuda_graphs=True, adaptive=False, **cfg))
    loop = eng.drafter.device_loop
    assert isinstance(loop, DeviceDynamicTree) and tuple(loop.shape) == shape
    pipelined = shape[2] + 1 if eng.drafter.pipelined else 0  # a queued step's rows reserve a path + bonus more
    assert eng.scheduler.lookahead == max(shape[2], shape[0] * (shape[1] - 1)) + pipelined
    sizes, calls, verify, run = [], [], eng.verifier.verify_proposal, loop.run

    def spy(rows, prop):  # (a device proposal's trees are known once verified)
        results = verify(rows, prop)
        sizes.extend((t.num_nodes, all(p < i for i, p in enumerate(t.host.parents))) for t in prop.trees)
        return results

    eng.verifier.verify_proposal = spy
    loop.run = lambda *a: calls.append(1) or run(*a)
    spec = eng.generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == want
    assert len(calls) > 0 and set(sizes) == {(shape[2], True)}
    assert sum(o.stats.accepted for o in spec) > 0 and eng.all_blocks_free()
    sizes.clear()
    eng.drafter.budget = 5  # an adaptive budget: each tree is cut to its best 5 nodes
    assert [o.token_ids for o in eng.generate(PROMPTS[:3], params)] == want[:3]
    assert set(sizes) == {(5, True)} and eng.all_blocks_free()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter runs Triton on the CPU; "
                    "on CUDA test_gpu_graphed_eagle_equals_target_only covers the compiled kernels")
@pytest.mark.parametrize("tree", ["dynamic:12:3x5"])  # (a static tree's program: the CPU-backend tests and the GPU's)
def test_device_tree_loop_on_the_triton_backend(setup, tree):
    """The device program with the Triton kernels (interpreted on the CPU): a batch-1 tree level's queries
    are laid out densely (an expanded positions view once made the RoPE kernel read past its end); a
    dynamic tree's levels attend through per-row masks built on the device."""
    root, _, target = setup
    draft = load_model(root / "full", target=target)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    cfg = dict(num_blocks=128, block_size=16)
    want = [o.token_ids for o in SpecEngine(None, target, SpecConfig(**cfg)).generate(PROMPTS[:1], params)]
    eng = SpecEngine(draft, target, SpecConfig(tree=tree, max_batch_size=1, cuda_graphs=True,
                                               attention_backend="triton", **cfg))
    assert eng.runner.backend.name == "triton" and eng.drafter.device_loop is not None
    assert eng.verifier.fused.writer.use_triton  # the kept trees reach the verify through kernels/tree_write.py
    assert [o.token_ids for o in eng.generate(PROMPTS[:1], params)] == want


def test_untrained_draft_over_a_partial_vocabulary_is_lossless(tiny_target):
    shape = EagleShape(default_aux_layers(tiny_target.config.num_layers), 100)
    vocab = torch.randperm(256, generator=torch.Generator().manual_seed(0))[:100].sort().values
    model = eagle_from_target(tiny_target.model, shape, vocab, seed=2).eval().requires_grad_(False)
    draft = LoadedModel("eagle", model, None, model.config)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 17, 40)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    cfg = dict(num_blocks=256, block_size=8)
    ref = [o.token_ids for o in SpecEngine(None, tiny_target, SpecConfig(**cfg)).generate(prompts, params)]
    for tree in ("chain:3", "dynamic:12"):
        out = SpecEngine(draft, tiny_target, SpecConfig(tree=tree, **cfg)).generate(prompts, params)
        assert [o.token_ids for o in out] == ref


def test_catch_up_state_equals_a_dense_forward_over_the_whole_sequence(setup):
    """The draft's root state at every step (paged KV written over prefill, catch-ups and
    adoption, features handed over by verify, a prefix-cache hit) equals one dense forward of the
    draft over the committed tokens with the target's features."""
    root, _, target = setup
    draft = load_model(root / "full", target=target)
    eng = SpecEngine(draft, target, SpecConfig(tree="topk:2x2", num_blocks=64, block_size=4))
    seen = []
    orig = eng.drafter._catch_up

    def spy(grows):
        orig(grows)
        seen.extend((list(g.req.tokens), g.hidden[-1].clone()) for g in grows)

    eng.drafter._catch_up = spy
    for prompts in (PROMPTS[:2], PROMPTS[1:3]):  # the second call finds PROMPTS[1] and the chat template's
        eng.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))  # first tokens cached
    assert len(seen) >= 10 and eng.scheduler.prefix_cache.stats.hits == 2
    m = draft.model
    for tokens, hidden in seen:
        ids = torch.tensor(tokens)
        n = len(tokens)
        with torch.no_grad():
            dense = DenseCausalBackend(), DenseBatch(1, n)
            ctx = ForwardContext(*dense, [(None, None)] * target.config.num_layers)
            _, aux = target.model.forward_features(ids, torch.arange(n), ctx, m.aux_layers)
            g = torch.cat([torch.zeros(1, m.config.hidden_size), m.fuse(aux)[:-1]])  # features of p - 1
            ref = m(ids, torch.arange(n), ForwardContext(*dense, [(None, None)]), g)
        torch.testing.assert_close(hidden, ref[-1], rtol=0, atol=1e-4)


def test_default_draft_name_loads_an_eagle_folder(setup, monkeypatch):
    from specdec.defaults import CUDA_DRAFT_TREE, default_draft, default_tree
    from specdec.loading import default_draft as drafts

    root, _, target = setup
    monkeypatch.setattr(drafts, "DEFAULT_DRAFT_DIR", root / "full")
    assert drafts.default_draft_available() and default_draft("smollm2-135m") == "smollm2-135m-draft"
    assert default_draft("another-target") == "ngram"
    assert default_draft("smollm2-135m", "cuda") == "smollm2-135m-draft"  # on CUDA too: its steps are pipelined
    assert (default_tree("smollm2-135m-draft", "cuda"), default_tree("smollm2-135m-draft", "cpu"),
            default_tree("ngram", "cuda")) == (CUDA_DRAFT_TREE, "chain:4", "chain:8")
    draft = load_model("smollm2-135m-draft", target=target)
    assert isinstance(draft.model, EagleDraft) and draft.name == "smollm2-135m-draft"


def test_unrolled_training_step_equals_the_tree_node_it_stands_for(tiny_target):
    """Step k at position p of the training forward == the depth-(k-1) node at p of a run-time
    chain drafted after a catch-up to p - k (computed here densely, one node at a time)."""
    from specdec.training.eagle_unroll import UnrolledBackend, UnrolledBatch, shift_right, teacher_forward

    t = tiny_target.model
    shape = EagleShape(default_aux_layers(t.config.num_layers), 50)
    m = eagle_from_target(t, shape, torch.arange(50), seed=4).eval().requires_grad_(False)
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    n = ids.shape[1]
    with torch.no_grad():
        teacher = teacher_forward(t, m, ids)
        ctx = ForwardContext(UnrolledBackend(), UnrolledBatch(1, n), [(None, None)])
        g, steps = shift_right(m.fuse(teacher.aux), 1, n), []
        for _ in range(3):
            steps.append(m(ids[0], torch.arange(n), ctx, g))
            g = shift_right(steps[-1], 1, n)
        for k in (1, 2):
            for p in (k, 7, n - 1):
                g = shift_right(m.fuse(teacher.aux), 1, n)[:p + 1].clone()  # target features up to p - k
                for _ in range(k + 1):  # each pass makes one more chain node read its parent's output
                    dense = ForwardContext(DenseCausalBackend(), DenseBatch(1, p + 1), [(None, None)])
                    out = m(ids[0, :p + 1], torch.arange(p + 1), dense, g)
                    g = torch.cat([g[:p - k + 1], out[p - k:p]])
                torch.testing.assert_close(steps[k][p], out[p], rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tree", ["chain:4", "topk:2x3", "dynamic:16"])
def test_gpu_graphed_eagle_equals_target_only(setup, tree):
    """float32 on the GPU with graphs captured: the verify graphs hand the draft its features, static and
    dynamic trees replay the device program, and greedy output equals eager target-only decoding."""
    root, _, _ = setup
    target = load_model(root / "target", device="cuda")
    draft = load_model(root / "full", target=target, device="cuda")
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    cfg = dict(max_batch_size=8, num_blocks=256, block_size=16, device="cuda")
    plain = SpecEngine(None, target, SpecConfig(cuda_graphs=False, **cfg)).generate(PROMPTS, params)
    eng = SpecEngine(draft, target, SpecConfig(tree=tree, **cfg))
    assert eng.graph_report is not None and eng.graph_report.graphs > 0
    assert eng.drafter.device_loop is not None and len(eng.drafter.device_loop.graphs) > 0
    spec = eng.generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    paths = eng.drafter.paths  # the verify launched with the draft; pipelined by default on CUDA
    assert paths["fused"] == paths["device"] + paths["ahead"] and paths["device"] > 0 and paths["ahead"] > 0
    assert eng.all_blocks_free()
