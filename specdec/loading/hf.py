"""Hugging Face checkpoint folders: config.json + safetensors (single file or sharded index) + tokenizer files.

A file that is unreadable or describes a model this engine cannot build is an ``UnsupportedModelError`` naming
the file and what is wrong in it, raised before any tensor is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specdec.loading.errors import ModelNotFoundError, UnsupportedModelError, unreadable

HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# config.json integers that size the model: each >= 1 when given (transformers' defaults fill the others)
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")
# the rope scaling types specdec.models.rope implements, with the numbers each needs
ROPE_KEYS = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path``; UnsupportedModelError when the file is not JSON or holds something else."""
    try:
        data = json.loads(path.read_bytes())
    except ValueError as err:  # (JSONDecodeError, UnicodeDecodeError)
        raise unreadable(path, "not valid JSON", err) from err
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{path}: expected a JSON object {{...}}, got a JSON {type(data).__name__}")
    return data


def check_config_fields(raw: dict, path: Path) -> None:
    """Refuse sizes that are not integers >= 1, norm eps or rope theta that are not numbers > 0, head counts that
    do not divide, architectures that are no list and rope scaling the model does not implement."""
    for name in SIZE_FIELDS:
        value = raw.get(name)
        if value is not None and (type(value) is not int or value < 1):
            raise UnsupportedModelError(f"{path}: {name} must be an integer >= 1, got {value!r}")
    for name in ("rms_norm_eps", "rope_theta"):
        value = raw.get(name)
        if value is not None and (type(value) not in (int, float) or not value > 0):
            raise UnsupportedModelError(f"{path}: {name} must be a number > 0, got {value!r}")
    hidden, heads = raw.get("hidden_size"), raw.get("num_attention_heads")
    if hidden and heads and raw.get("head_dim") is None and hidden % heads:
        raise UnsupportedModelError(f"{path}: hidden_size ({hidden}) must be a multiple of num_attention_heads "
                                    f"({heads}) when head_dim is not given")
    kv_heads = raw.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise UnsupportedModelError(f"{path}: num_attention_heads ({heads}) must be a multiple of "
                                    f"num_key_value_heads ({kv_heads})")
    archs = raw.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise UnsupportedModelError(f"{path}: architectures must be a list of class names, got {archs!r}")
    for key in ("rope_scaling", "rope_parameters"):
        _check_rope(raw.get(key), key, path)


def _check_rope(rope: object, key: str, path: Path) -> None:
    """``rope`` (config.json's ``key``) is null or an object of a type ``ROPE_KEYS`` lists, with its numbers."""
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise UnsupportedModelError(f"{path}: {key} must be an object or null, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_KEYS:
        raise UnsupportedModelError(f"{path}: {key} type {kind!r} is not supported; supported: "
                                    f"{', '.join(ROPE_KEYS)}")
    bad = [k for k in ROPE_KEYS[kind] if type(rope.get(k)) not in (int, float)]
    if bad:
        raise UnsupportedModelError(f"{path}: {key} of type {kind!r} needs numbers {bad}, got {rope!r}")


def read_hf_config(folder: Path):
    """The transformers config of a checkpoint folder; refuses unreadable or invalid files and unsupported
    architectures (a config without ``architectures`` is taken by its ``model_type``)."""
    from transformers import AutoConfig

    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelNotFoundError(f"{folder} has no config.json")
    check_config_fields(read_json_object(cfg_path), cfg_path)
    try:
        cfg = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as err:  # transformers' validators raise ValueError, TypeError, OSError, huggingface_hub's own
        raise unreadable(cfg_path, "transformers cannot read this config", err) from err
    archs = getattr(cfg, "architectures", None) or []
    if (archs[0] if archs else MODEL_TYPES.get(cfg.model_type)) not in HF_ARCHITECTURES:
        named = f"architecture {archs[0]!r}" if archs else f"model_type {cfg.model_type!r}"
        raise UnsupportedModelError(f"{named} in {cfg_path} is not supported; supported: "
                                    f"{', '.join(HF_ARCHITECTURES)}")
    return cfg


def read_hf_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of the folder's safetensors file(s), keyed by Hugging Face parameter name."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise UnsupportedModelError(f"{index}: weight_map must be an object of tensor name -> file name")
        files = sorted(set(weight_map.values()))
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
            raise unreadable(path, "cannot read the safetensors file, it may be truncated or corrupt", err) from err
    return state


def read_hf_tokenizer(folder: Path):
    """The folder's tokenizer, None when it has no tokenizer files; a corrupt file is an UnsupportedModelError."""
    from transformers import AutoTokenizer

    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as err:  # (tokenizers raises plain Exception for a tokenizer.json of the wrong shape)
        for name in TOKENIZER_JSON:  # name the file when one is no JSON object
            if (folder / name).is_file():
                read_json_object(folder / name)
        raise unreadable(folder, "cannot load the tokenizer", err) from err
