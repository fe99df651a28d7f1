"""Hugging Face checkpoint folders: config.json + safetensors (single file or sharded index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specdec.loading.errors import ModelNotFoundError, UnsupportedModelError

HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def read_hf_config(folder: Path):
    """The transformers config of a checkpoint folder; refuses unsupported architectures."""
    from transformers import AutoConfig

    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelNotFoundError(f"{folder} has no config.json")
    cfg = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    archs = getattr(cfg, "architectures", None) or []
    if not archs or archs[0] not in HF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {archs[0] if archs else cfg.model_type!r} in {cfg_path} is not supported; "
            f"supported: {', '.join(HF_ARCHITECTURES)}"
        )
    return cfg


def read_hf_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of the folder's safetensors file(s), keyed by Hugging Face parameter name."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise ModelNotFoundError(f"shard {name} listed in {index} is missing")
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError) as err:
            raise UnsupportedModelError(f"{path}: cannot read the safetensors file, it may be truncated or "
                                        f"corrupt ({err})") from err
    return state
