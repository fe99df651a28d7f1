"""Draft folders: a Hugging Face-style folder holding only a draft's trained tensors.

A folder has ``config.json`` (a transformers config with the draft's layer count),
``model.safetensors`` (decoder layers + final norm only), the tokenizer files, and
``specdec_draft.json``, which names the target whose embeddings (and LM head) the draft shares
and records how the draft was trained. Loading resolves the shared tensors from that target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specdec.config import ModelConfig
from specdec.loading.base import LoadedModel, build_model, resolve_dtype
from specdec.loading.draft_format import DRAFT_META, FORMAT, VERSION, check_shared, fingerprint
from specdec.loading.draft_layers import TRAINED_PREFIXES, shared_keys, trained_state
from specdec.loading.errors import ModelNotFoundError, UnsupportedModelError

HF_CONFIG_CLASSES = {"LlamaForCausalLM": "LlamaConfig", "Qwen2ForCausalLM": "Qwen2Config",
                     "MistralForCausalLM": "MistralConfig"}


def is_draft_folder(path: str | Path) -> bool:
    """True when ``path`` is a folder carrying a ``specdec_draft.json``."""
    return (Path(path) / DRAFT_META).is_file()


def hf_config(cfg: ModelConfig):
    """A transformers config that ``ModelConfig.from_hf`` reads back as ``cfg``."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
    kwargs: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, rope_parameters=rope,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=list(cfg.eos_token_ids) or None,
    )
    if cfg.architecture == "Qwen2ForCausalLM":
        kwargs.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window)
    else:
        kwargs.update(attention_bias=cfg.attention_bias, sliding_window=cfg.sliding_window)
        if cfg.architecture == "LlamaForCausalLM":
            kwargs.pop("sliding_window")
    out = getattr(transformers, HF_CONFIG_CLASSES[cfg.architecture])(**kwargs)
    out.architectures = [cfg.architecture]
    return out


def save_draft_folder(out: str | Path, draft: LoadedModel, target: LoadedModel, target_ref: str,
                      extra: dict, save_dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``draft`` to folder ``out``; returns the path of its ``model.safetensors``.

    ``target_ref`` is what ``load_draft_folder`` passes to ``load_model`` to get the shared
    tensors (a registered name or an absolute path); ``extra`` (JSON-able) is stored in
    ``specdec_draft.json`` next to the format fields.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf_config(draft.config).save_pretrained(str(out))
    state = {k: v.to(save_dtype).contiguous().cpu() for k, v in trained_state(draft.model).items()}
    weights = out / "model.safetensors"
    save_file(state, str(weights), metadata={"format": "pt"})
    if target.tokenizer is not None:
        target.tokenizer.save_pretrained(str(out))
    target_state = target.model.state_dict()
    shared = shared_keys(draft.config.tie_word_embeddings)
    meta = {"format": FORMAT, "version": VERSION, "target": target_ref, "shared": shared,
            "shared_fingerprint": {k: fingerprint(target_state[k]) for k in shared}, **extra}
    (out / DRAFT_META).write_text(json.dumps(meta, indent=1))
    return weights


def read_draft_meta(path: str | Path) -> dict:
    """The parsed ``specdec_draft.json`` of a draft folder, checked for format and version."""
    file = Path(path) / DRAFT_META
    if not file.is_file():
        raise ModelNotFoundError(f"{path} is not a draft folder: it has no {DRAFT_META}")
    meta = json.loads(file.read_text())
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise UnsupportedModelError(f"{file}: expected format {FORMAT!r} version {VERSION}, got "
                                    f"{meta.get('format')!r} version {meta.get('version')!r}")
    return meta


def load_draft_folder(path: str | Path, dtype: torch.dtype | str = torch.float32,
                      device: torch.device | str = "cpu",
                      target: LoadedModel | str | None = None) -> LoadedModel:
    """Load a draft folder as a ready ``LoadedModel`` (dtype/device as asked).

    The shared embeddings / LM head come from ``target``: a ``LoadedModel`` (its tensors are used
    by reference when dtype and device already match), a base model name/path for ``load_base_model``, or None
    for the target recorded in the folder. A target whose shared tensors differ in shape or
    statistics from the recorded fingerprint raises ``UnsupportedModelError``.
    """
    from transformers import AutoTokenizer

    from specdec.loading.base import load_base_model
    from specdec.loading.hf import read_hf_config

    path, dtype = Path(path), resolve_dtype(dtype)
    meta = read_draft_meta(path)
    if not isinstance(target, LoadedModel):
        target = load_base_model(target or meta["target"], dtype=dtype, device=device)
    if meta.get("kind") == "eagle":
        from specdec.loading.eagle_folder import load_eagle_folder

        return load_eagle_folder(path, meta, dtype, device, target)
    cfg = ModelConfig.from_hf(read_hf_config(path))
    own = load_file(str(path / "model.safetensors"))
    bad = [k for k in own if not k.startswith(TRAINED_PREFIXES)]
    if bad:
        raise UnsupportedModelError(f"{path}/model.safetensors holds non-draft tensors {bad[:3]}")
    target_state = target.model.state_dict()
    for key in meta["shared"]:
        check_shared(path, key, target_state.get(key), meta["shared_fingerprint"][key], target.name)
        own[key] = target_state[key]
    model = build_model(cfg, own, dtype, device, source=path)
    tok = (AutoTokenizer.from_pretrained(str(path), local_files_only=True)
           if (path / "tokenizer_config.json").is_file() else target.tokenizer)
    return LoadedModel(str(path), model, tok, cfg)
