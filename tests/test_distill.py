"""``specdec distill`` end to end on a tiny random Llama: KL falls, exact resume, draft folder format."""

from __future__ import annotations

import json
import random
import string
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from specdec.cli import main
from specdec.config import ModelConfig
from specdec.engine import SpecConfig, SpecEngine
from specdec.loading import default_draft as drafts
from specdec.loading.default_draft import load_default_draft, load_draft_folder
from specdec.loading.draft_layers import target_layer_map
from specdec.loading.errors import ModelNotFoundError, UnsupportedModelError
from specdec.loading.registry import LoadedModel, build_model, load_model
from specdec.sampling_params import SamplingParams
from specdec.training.configs import DistillConfig
from specdec.training.dense_attention import dense_hidden
from specdec.training.distill_data import describe_source, load_train_prompts, prompt_token_ids
from specdec.training.training import batch_indices, lr_at

STEPS = 40
RUN_ARGS = ["--num-prompts", "16", "--val-prompts", "4", "--response-tokens", "16", "--steps", str(STEPS),
            "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "4", "--ckpt-every", "10",
            "--device", "cpu", "--seed", "3"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _save_tiny_target(path, seed: int = 0) -> None:
    """A 4-layer Llama (vocab 128, hidden 64) with a character-level chat tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = string.ascii_letters + string.digits + " .,!?'\n:-"
    tokens = ["<unk>", "<|im_start|>", "<|im_end|>", *chars]
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path))
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=None, initializer_range=0.2)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(str(path))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices gain nothing from threads, and on a busy 2-core machine they cost 10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    _save_tiny_target(root / "target")
    rng = random.Random(0)
    words = "the cat dog sat on a mat big red blue runs fast tree house why how what is are".split()
    with (root / "prompts.jsonl").open("w") as fp:
        for _ in range(20):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))
            fp.write(json.dumps({"prompt": text}) + "\n")
    base = ["distill", "--target", str(root / "target"), "--data", str(root / "prompts.jsonl"), *RUN_ARGS]
    assert main([*base, "--out", str(root / "full")]) == 0
    return root, base


def _ckpt(folder):
    return torch.load(folder / "ckpt.pt", weights_only=False)


def test_kl_falls(setup):
    root, _ = setup
    losses = _ckpt(root / "full")["state"]["losses"]
    assert len(losses) == STEPS
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < 0.6 * first, (first, last)
    record = json.loads((root / "full" / "specdec_draft.json").read_text())["training"]
    assert record["steps"] == STEPS and record["num_prompts"] == 16 and record["loss_curve"]
    val = record["val_kl"]  # held-out prompts: step 0, every checkpoint, end
    assert [s for s, _ in val] == [0, 10, 20, 30, 40] and val[-1][1] < 0.8 * val[0][1], val


def test_interrupted_then_resumed_run_matches_uninterrupted(setup):
    root, base = setup
    out = root / "resumed"
    assert main([*base, "--out", str(out), "--stop-after", str(STEPS // 2)]) == 0
    assert _ckpt(out)["state"]["step"] == STEPS // 2
    assert not (out / "model.safetensors").exists()  # not exported before training finished
    data_mtime = (out / "data.pt").stat().st_mtime_ns
    assert main([*base, "--out", str(out), "--resume"]) == 0
    assert (out / "data.pt").stat().st_mtime_ns == data_mtime  # responses were not generated again
    full, resumed = _ckpt(root / "full"), _ckpt(out)
    assert resumed["state"]["losses"] == pytest.approx(full["state"]["losses"], abs=1e-6)
    for name, w in full["trained"].items():
        torch.testing.assert_close(resumed["trained"][name], w, rtol=0, atol=1e-6)


def test_resume_refuses_other_training_options(setup):
    root, base = setup
    args = [*base, "--out", str(root / "full"), "--resume"]
    args[args.index("--lr") + 1] = "1e-3"
    assert main(args) == 2  # a ValueError naming the differing option


def test_folder_stores_only_trained_tensors(setup):
    root, _ = setup
    out = root / "full"
    keys = set(load_file(str(out / "model.safetensors")))
    target = load_model(root / "target")
    names = [n for n, _ in target.model.model.layers[0].named_parameters()]
    expected = {f"model.layers.{i}.{n}" for i in range(2) for n in names}
    assert keys == expected | {"model.norm.weight"}
    meta = json.loads((out / "specdec_draft.json").read_text())
    assert meta["shared"] == ["model.embed_tokens.weight"] and meta["target_layers"] == [0, 3]
    assert meta["target"] == str((root / "target").resolve())
    from specdec.loading.hf import read_hf_config

    assert ModelConfig.from_hf(read_hf_config(out)) == replace(target.config, num_layers=2)


def test_draft_folder_loads_and_drafts_losslessly(setup):
    root, _ = setup
    target = load_model(root / "target")
    by_ref = load_draft_folder(root / "full")  # resolves the recorded target path itself
    draft = load_draft_folder(root / "full", target=target)
    embed = target.model.model.embed_tokens.weight
    assert draft.model.model.embed_tokens.weight.data_ptr() == embed.data_ptr()  # shared, not copied
    for a, b in zip(by_ref.model.parameters(), draft.model.parameters(), strict=True):
        assert torch.equal(a, b)
    prompts = [[{"role": "user", "content": f"the cat {i} sat"}] for i in range(4)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    cfg = SpecConfig(tree="chain:3", max_batch_size=4, num_blocks=128)
    spec = SpecEngine(draft, target, cfg).generate(prompts, params)
    plain = SpecEngine(None, target, cfg).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.stats.accepted for o in spec) > 0


def test_load_draft_folder_rejects_another_target(setup):
    root, _ = setup
    target = load_model(root / "target")
    state = dict(target.model.state_dict())
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * 2
    other = LoadedModel("other", build_model(target.config, state, torch.float32, "cpu"), None, target.config)
    with pytest.raises(UnsupportedModelError, match="embed_tokens"):
        load_draft_folder(root / "full", target=other)


def test_registry_loads_draft_folders(setup):
    import inspect

    from specdec.loading import registry

    if "load_draft_folder" not in inspect.getsource(registry):
        pytest.skip("registry.load_model does not route draft folders to load_draft_folder yet")
    root, _ = setup
    assert load_model(root / "full").config.num_layers == 2


def test_default_draft(setup, tmp_path, monkeypatch):
    root, _ = setup
    monkeypatch.setattr(drafts, "DEFAULT_DRAFT_DIR", tmp_path / "missing")
    assert not drafts.default_draft_available()
    with pytest.raises(ModelNotFoundError, match="specdec distill"):
        load_default_draft()
    monkeypatch.setattr(drafts, "DEFAULT_DRAFT_DIR", root / "full")
    assert drafts.default_draft_available()
    assert load_default_draft().name == "smollm2-135m-draft"


def test_dense_forward_matches_transformers(setup):
    from transformers import AutoModelForCausalLM

    root, _ = setup
    target = load_model(root / "target")
    hf = AutoModelForCausalLM.from_pretrained(str(root / "target")).eval()
    ids = torch.randint(0, 128, (3, 17))
    with torch.no_grad():
        ours = target.model.compute_logits(dense_hidden(target.model, ids))  # (B, S, V)
        ref = hf(ids).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)


def test_prompt_truncation_keeps_generation_header(setup):
    from transformers import AutoTokenizer

    from specdec.benchmark.data import BenchPrompt

    root, _ = setup
    tok = AutoTokenizer.from_pretrained(str(root / "target"))
    header = tok.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    ids = prompt_token_ids(BenchPrompt("1", "x", prompt="a long prompt " * 40), tok, 40)
    assert len(ids) <= 40 and ids[-len(header):] == header
    short = prompt_token_ids(BenchPrompt("2", "x", prompt="hi"), tok, 40)
    assert short == tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False)


def test_sharegpt_training_prompts_come_from_the_train_split(tmp_path, monkeypatch):
    from specdec.benchmark import data as bench_data

    convs = [{"conversations": [{"from": "human", "value": f"question {i}"}]} for i in range(65)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    indices = [i for i, _ in bench_data.iter_sharegpt("train", path=path)]
    assert len(indices) == 65 - 4 and all(i % 20 for i in indices)
    monkeypatch.setattr(bench_data, "sharegpt_path", lambda: path)
    prompts = load_train_prompts("sharegpt", 50)
    assert len(prompts) == 50 and all(int(p.id) % 20 for p in prompts)
    out = tmp_path / "train.jsonl"  # --write-prompts: the same prompts, for a machine without ShareGPT
    assert main(["distill", "--num-prompts", "50", "--write-prompts", str(out)]) == 0
    again = load_train_prompts(str(out), 50)
    assert [p.messages for p in again] == [p.messages for p in prompts]
    assert "ShareGPT V3 train split (index % 20 != 0)" in describe_source(str(out), again)


def test_batch_order_and_schedule():
    order = [i for s in range(5) for i in batch_indices(s, 10, 4, seed=1)]  # two epochs
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:20]) == list(range(10))
    again, other = batch_indices(3, 10, 4, seed=1), batch_indices(3, 10, 4, seed=2)
    assert order[12:16] == again != other
    cfg = DistillConfig("out", steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)


def test_target_layer_map():
    assert target_layer_map(30, 2) == [0, 29] and target_layer_map(30, 1) == [0]
    assert target_layer_map(30, 4) == [0, 10, 19, 29] and target_layer_map(4, 4) == [0, 1, 2, 3]
    assert target_layer_map(30, 2, (0, 28)) == [0, 28]
    with pytest.raises(ValueError, match="init_layers"):
        target_layer_map(30, 2, (0, 30))
    with pytest.raises(ValueError, match="layers must be in"):
        target_layer_map(4, 5)


@pytest.mark.parametrize("field,value", [("layers", 0), ("data", "foo.txt"), ("stop_after", 50),
                                         ("temperature", -1.0), ("device", "tpu"), ("val_prompts", 20),
                                         ("init_layers", (0, 1, 2))])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        DistillConfig("out", **{"steps": 10, "warmup_steps": 1, "num_prompts": 20, field: value})
