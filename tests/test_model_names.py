"""Model names as users coming from transformers and vLLM give them: a Hugging Face id found in the local cache
(never downloaded), and ``"none"`` as the draft of target-only decoding."""

from __future__ import annotations

import shutil

import pytest

from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.loading.errors import ModelNotFoundError
from specdec.loading.registry import load_model

PROMPT = [17, 4, 99, 23, 5]
PARAMS = SamplingParams(max_new_tokens=5, ignore_eos=True)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_llama_dir):
    """A Hugging Face cache holding ``tiny-org/tiny-llama`` (one snapshot, the tiny checkpoint's files)."""
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    snap = repo / "snapshots" / "0123abcd"
    shutil.copytree(tiny_llama_dir, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snap


def test_a_hub_id_in_the_cache_loads_its_snapshot(hub_cache, tiny_llama_dir):
    """The id loads the cached snapshot, keeps the id as its name, and decodes what the folder itself decodes."""
    by_id = load_model("tiny-org/tiny-llama")
    assert by_id.name == "tiny-org/tiny-llama"
    cfg = SpecConfig(num_blocks=32, block_size=4)
    got = SpecEngine(None, "tiny-org/tiny-llama", cfg).generate([PROMPT], PARAMS)[0].outputs[0].token_ids
    want = SpecEngine(None, str(tiny_llama_dir), cfg).generate([PROMPT], PARAMS)[0].outputs[0].token_ids
    assert got == want


def test_a_hub_id_downloaded_at_a_revision_loads_its_one_snapshot(hub_cache):
    """A cache entry with one snapshot and no ``main`` ref (downloaded with ``--revision``) loads that snapshot;
    with two such snapshots the id is ambiguous and not found."""
    (hub_cache.parent.parent / "refs" / "main").unlink()
    assert load_model("tiny-org/tiny-llama").name == "tiny-org/tiny-llama"
    shutil.copytree(hub_cache, hub_cache.parent / "4567cdef")
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache"):
        load_model("tiny-org/tiny-llama")


def test_a_hub_id_not_in_the_cache_says_how_to_fetch_it(hub_cache):
    with pytest.raises(ModelNotFoundError, match=r"not in the Hugging Face cache.*huggingface-cli download "
                                                 r"other-org/missing"):
        load_model("other-org/missing")


def test_a_missing_path_keeps_the_plain_message(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found: give 'smollm2-135m'"):
        load_model(str(tmp_path / "nowhere" / "model"))


@pytest.mark.parametrize("none", ["none", "None"])
def test_draft_none_is_target_only_decoding(tiny_target, none):
    cfg = SpecConfig(num_blocks=32, block_size=4)
    eng = SpecEngine(none, tiny_target, cfg)
    assert eng.plan.proposer == "none"
    want = SpecEngine(None, tiny_target, cfg).generate([PROMPT], PARAMS)[0].outputs[0].token_ids
    assert eng.generate([PROMPT], PARAMS)[0].outputs[0].token_ids == want
