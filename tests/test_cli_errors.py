"""CLI user errors: ``error: <argument>: <what>`` on stderr, exit status 2, no traceback, and found
before any model loads."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import refuse_model_loads, run_cli
from serving_helpers import with_tokenizer

from specdec.cli import main


@pytest.fixture
def no_model_load(monkeypatch):
    refuse_model_loads(monkeypatch)


@pytest.mark.parametrize("argv,words", [
    (["generate", "--prompt", "hi", "--model", "/nonexistent"], ["--model", "/nonexistent", "does not exist"]),
    (["generate", "--prompt", "hi", "--model", ""], ["--model", "empty"]),
    (["generate", "--prompt", "hi", "--model", "no-such-org/no-such-model"],
     ["--model", "not in the Hugging Face cache", "huggingface-cli download no-such-org/no-such-model"]),
    (["generate", "--prompt", "hi", "--draft", "/no/draft"], ["--draft", "/no/draft"]),
    (["generate", "--prompt", "hi", "--temperature", "-1"], ["--temperature", ">= 0"]),
    (["generate", "--prompt", "hi", "--temperature", "inf"], ["--temperature", "finite"]),
    (["generate", "--prompt", "hi", "--top-p", "0"], ["--top-p", "(0, 1]"]),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["generate", "--prompt", "hi", "--seed", "-3"], ["--seed", ">= 0"]),
    (["generate", "--prompt", "hi", "--n", "0"], ["--n", ">= 1"]),
    (["generate", "--prompt", "hi", "--min-p", "1.5"], ["--min-p", "[0, 1]"]),
    (["generate", "--prompt", "hi", "--repetition-penalty", "0"], ["--repetition-penalty", "> 0"]),
    (["generate", "--prompt", "hi", "--presence-penalty", "3"], ["--presence-penalty", "[-2, 2]"]),
    (["generate", "--prompt", "hi", "--frequency-penalty", "-2.5"], ["--frequency-penalty", "[-2, 2]"]),
    (["generate", "--prompt", "hi", "--tree", "foo:3"], ["--tree", "foo:3"]),
    (["generate", "--prompt", "hi", "--device", "gpu"], ["--device", "gpu"]),
    (["bench", "--dataset", "missing.jsonl"], ["--dataset", "missing.jsonl", "does not exist"]),
    (["serve", "--draft", "none", "--max-batch-size", "1000000000"], ["--max-batch-size", "<= 4096"]),
    (["serve", "--draft", "none", "--max-request-bytes", "0"], ["--max-request-bytes", ">= 1"]),
    (["serve", "--draft", "none", "--max-num-batched-tokens", "0"], ["--max-num-batched-tokens", ">= 1"]),
    (["bench", "--dataset", "nosuchset"], ["--dataset", "mtbench"]),
    (["bench", "--batch-size", "0"], ["--batch-size", ">= 1"]),
    (["bench", "--num-prompts", "0"], ["--num-prompts", ">= 1"]),
    (["bench", "--target", "/nonexistent"], ["--model", "/nonexistent"]),  # --target: the alias of --model
    (["serve", "/nonexistent"], ["--model", "/nonexistent"]),
    (["bench", "--tree", "chain:99"], ["--tree", "[1, 63]"]),
])
def test_user_errors_name_the_argument(capsys, no_model_load, argv, words):
    err = run_cli(capsys, argv)
    assert all(w in err for w in words), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given without a GPU")
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["bench"]])
def test_cuda_without_a_gpu(capsys, no_model_load, command):
    err = run_cli(capsys, [*command, "--device", "cuda"])
    assert err.startswith(f"error: --device: is a CUDA device, but this torch ({torch.__version__}) sees no CUDA "
                          f"device: use 'cpu' or "), err
    assert err.rstrip().endswith("got 'cuda'"), err


def test_truncated_checkpoint(capsys, tiny_llama_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((tiny_llama_dir / "config.json").read_bytes())
    data = (tiny_llama_dir / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:100])
    err = run_cli(capsys, ["generate", "--prompt", "hi", "--model", str(broken), "--device", "cpu"])
    assert "--model" in err and str(broken / "model.safetensors") in err


def _spoiled(src, dst, config: dict | None = None, weights: dict | None = None, index: str | None = None):
    """A copy of checkpoint folder ``src`` with ``config`` merged into config.json, ``weights`` into
    model.safetensors and ``index`` written as model.safetensors.index.json."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    if weights is not None:
        save_file({**load_file(str(dst / "model.safetensors")), **weights}, str(dst / "model.safetensors"))
    if index is not None:
        (dst / "model.safetensors.index.json").write_text(index)
    return dst


@pytest.mark.parametrize("spoil,words", [
    (dict(config={"num_attention_heads": 0}), ["config.json", "num_attention_heads must be an integer >= 1, got 0"]),
    (dict(config={"rms_norm_eps": "x"}), ["config.json", "rms_norm_eps must be a number > 0, got 'x'"]),
    (dict(config={"num_key_value_heads": 0}), ["config.json", "num_key_value_heads must be an integer >= 1"]),
    (dict(weights={"model.norm.weight": torch.zeros(65)}), ["model.norm.weight (65,), expected (64,)"]),
    (dict(index="{}"), ["model.safetensors.index.json", "weight_map"]),
], ids=["heads-0", "eps-string", "kv-heads-0", "wrong-shape", "index-without-weight-map"])
def test_hostile_checkpoint_folders(capsys, tiny_llama_dir, tmp_path, spoil, words):
    """What used to end in a traceback from transformers or torch is one ``error: --model: <file>: ...`` line."""
    broken = _spoiled(tiny_llama_dir, tmp_path / "broken", **spoil)
    err = run_cli(capsys, ["generate", "--prompt", "hi", "--model", str(broken), "--draft", "none", "--device", "cpu",
                           "--max-new-tokens", "4"])
    assert err.startswith("error: --model: ") and str(broken) in err and err.count("\n") == 1, err
    assert all(w in err for w in words), err


def test_generate_with_token_level_errors_still_exits_2(capsys, tiny_llama_dir):
    """A text prompt for a model without a tokenizer: the request error is printed, exit 2."""
    err = run_cli(capsys, ["generate", "--prompt", "hi", "--model", str(tiny_llama_dir), "--draft", "none",
                           "--device", "cpu"])
    assert "tokenizer" in err


@pytest.mark.parametrize("n", ["1", "2"])
def test_max_new_tokens_beyond_the_context_names_the_flag(capsys, tiny_dirs, tmp_path, n):
    """Was ``error: SamplingParams.max_new_tokens with a 2-token prompt exceeds ...``: the request's field, not the
    flag that set it (streamed, and --n 2's samples printed at the end)."""
    model = with_tokenizer(tiny_dirs["llama"], tmp_path / "llama")
    err = run_cli(capsys, ["generate", "--prompt", "hi", "--model", str(model), "--draft", "none", "--device", "cpu",
                           "--max-new-tokens", "100000", "--n", n])
    assert err.startswith("error: --max-new-tokens: ") and "max length 512" in err, err
    assert len(err.splitlines()) == 1, err


def test_pipeline_and_adaptive_flags_reach_the_engine_config(monkeypatch):
    """``--pipeline`` and ``--adaptive`` (auto / on / off) become ``SpecConfig``'s None / True / False on ``specdec
    bench`` and ``specdec generate``; the engine resolves auto (``test_lookahead``)."""
    import specdec.cli.checks as checks

    seen = {}

    class Built(Exception):
        pass

    def build(cls, **fields):  # stop at the engine config, before any model loads
        seen[cls.__name__] = fields
        if cls.__name__ == "SpecConfig":
            raise Built
        return cls(**fields)

    monkeypatch.setattr(checks, "build", build)
    for argv, want in ((["--pipeline", "on"], (True, None)), (["--pipeline", "off", "--adaptive", "on"], (False, True)),
                       ([], (None, None))):
        with pytest.raises(Built):
            main(["bench", "--device", "cpu", *argv])
        assert (seen["SpecConfig"]["pipeline"], seen["SpecConfig"]["adaptive"]) == want
    for argv, want in ((["--pipeline", "on"], True), ([], None), (["--pipeline", "off"], False)):
        seen.clear()
        with pytest.raises(Built):
            main(["generate", "--device", "cpu", "--prompt", "hi", *argv])
        assert seen["SpecConfig"]["pipeline"] is want
    with pytest.raises(SystemExit):
        main(["bench", "--pipeline", "yes"])


def test_sampling_with_a_draft_on_cuda_gets_a_speed_note():
    """``specdec generate`` warns (on stderr) only when it samples with a draft on CUDA, where sampled speculation
    may not beat target-only decoding; the note names the target-only flag and states no speed figures."""
    from specdec.cli.main import sampled_speed_note

    note = sampled_speed_note("cuda", 0.7, "smollm2-135m-draft")
    assert "--draft none" in note and "target-only" in note
    assert not any(ch.isdigit() for ch in note), note  # figures go stale; bench/RESULTS.md holds them
    assert "--draft none" in sampled_speed_note("cuda:0", 0.7, "ngram")
    assert sampled_speed_note("cuda", 0.0, "ngram") is None  # greedy
    assert sampled_speed_note("cuda", 0.7, "none") is None  # target-only already
    assert sampled_speed_note("cpu", 0.7, "ngram") is None


def test_bench_refuses_draft_none_saying_why(capsys, no_model_load):
    """bench compares a draft with target-only decoding; 'none' was "does not exist" (as if a path)."""
    err = run_cli(capsys, ["bench", "--device", "cpu", "--draft", "none"])
    assert err.startswith("error: --draft: bench measures a draft against target-only decoding"), err


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["bench"]])
def test_tree_auto_is_the_default_tree(monkeypatch, command):
    """``--tree auto`` (listed in --help) is what no --tree gives, for generate and bench alike."""
    import specdec.cli.checks as checks

    trees = []

    class Built(Exception):
        pass

    def build(cls, **fields):  # stop at the engine config, before any model loads
        if cls.__name__ == "SpecConfig":
            trees.append(fields["tree"])
            raise Built
        return cls(**fields)

    monkeypatch.setattr(checks, "build", build)
    for tree in ([], ["--tree", "auto"]):
        with pytest.raises(Built):
            main([*command, "--device", "cpu", "--draft", "ngram", *tree])
    assert trees[0] == trees[1] == "chain:8", trees
