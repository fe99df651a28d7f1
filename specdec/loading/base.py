"""``load_base_model``: ``smollm2-135m``, HF folders and GGUF files -> a ready ``LoadedModel``.

Draft folders (which name a base model as their target) are loaded by ``specdec.loading.registry``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.config import DTYPE_NAMES, ModelConfig
from specdec.loading.errors import ModelNotFoundError, UnsupportedModelError, unreadable
from specdec.models.llama import LlamaForCausalLM

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
# other spellings of them, as vLLM's --dtype and common shorthands take
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}


@dataclass
class LoadedModel:
    """A model ready to run, with the tokenizer it was trained with."""

    name: str
    model: LlamaForCausalLM
    tokenizer: Any
    config: ModelConfig

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def model_name(name_or_path: str | Path) -> str:
    """``name_or_path`` as a string; TypeError for anything but a str or Path, ModelNotFoundError when empty."""
    if not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"model must be a name or a path (str or Path), got {type(name_or_path).__name__}")
    name = str(name_or_path)
    if not name.strip():
        raise ModelNotFoundError("model name is empty: give 'smollm2-135m', a Hugging Face checkpoint folder "
                                 "or a .gguf file")
    return name


# a Hugging Face repository id: "owner/name" (letters, digits, '-', '_', '.'), neither part starting with '.'
_HUB_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*/[A-Za-z0-9_-][A-Za-z0-9_.-]*")


def looks_like_hub_id(name: str) -> bool:
    """``name`` reads as a Hugging Face repository id ("HuggingFaceTB/SmolLM2-135M-Instruct") and is no local path."""
    return bool(_HUB_ID.fullmatch(name)) and not Path(name).expanduser().exists()


def local_path(name: str) -> Path:
    """Where model ``name`` lies on this machine: the path itself, or, for a Hugging Face repository id that is no
    local path, its snapshot folder in the Hugging Face cache (``HF_HUB_CACHE``) when it was downloaded before.
    Nothing is ever downloaded; an id not in the cache comes back as the path it names (which does not exist)."""
    path = Path(name).expanduser()
    if path.exists() or not looks_like_hub_id(name):
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # (not in the cache, or no huggingface_hub: the caller's "not found" says what to do)
        return _lone_snapshot(name) or path


def _lone_snapshot(name: str) -> Path | None:
    """The snapshot folder of hub id ``name`` when the cache holds exactly one and no ``main`` ref points at any
    (what `huggingface-cli download ID --revision REV` leaves), else None."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    snapshots = Path(constants.HF_HUB_CACHE) / f"models--{name.replace('/', '--')}" / "snapshots"
    found = [p for p in snapshots.iterdir() if p.is_dir()] if snapshots.is_dir() else []
    return found[0] if len(found) == 1 else None


def not_found(name: str) -> ModelNotFoundError:
    """The error for a model ``name`` that is neither a known name nor on this machine."""
    if looks_like_hub_id(name):
        return ModelNotFoundError(
            f"model {name!r} is not a local path and not in the Hugging Face cache: specdec never downloads; fetch "
            f"it first (`huggingface-cli download {name}`), then give the same id or the folder")
    return ModelNotFoundError(
        f"model {name!r} not found: give 'smollm2-135m', a Hugging Face checkpoint folder, a Hugging Face id "
        f"already in the local cache, or a .gguf file")


def load_base_model(
    name_or_path: str | Path, dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu"
) -> LoadedModel:
    """Load ``smollm2-135m``, a Hugging Face folder (or the id of one in the Hugging Face cache) or a GGUF file (not
    a draft folder)."""
    dtype = resolve_dtype(dtype)
    name = model_name(name_or_path)
    if name == "smollm2-135m":
        from specdec.loading.gguf_loader import smollm2_gguf_path

        return _from_gguf(smollm2_gguf_path(), name, dtype, device)
    path = local_path(name)
    if path.is_dir():
        return _from_hf_folder(path, name, dtype, device)
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, name, dtype, device)
    if path.is_file():
        raise UnsupportedModelError(f"{path}: expected a .gguf file or a Hugging Face checkpoint folder")
    raise not_found(name)


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype, device,
                source: str | Path = "checkpoint") -> LlamaForCausalLM:
    """Instantiate the module and load ``state`` strictly: a missing, unexpected, misshapen or non-float tensor
    is an UnsupportedModelError naming ``source`` (the file or folder the tensors came from)."""
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
    except ValueError as err:  # (e.g. a rope scaling type the model does not implement)
        raise UnsupportedModelError(f"{source}: {err}") from err
    state = dict(state)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    wanted = {k: v for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    _check_tensors(state, wanted, source, cfg.architecture)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items() if k in wanted}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rope = model.rope.__class__(cfg).to(device)
    return model.eval().requires_grad_(False)


def _check_tensors(state: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor], source, arch: str) -> None:
    """``state`` holds exactly the ``wanted`` names (a stored ``rotary_emb.inv_freq`` aside), each of the wanted
    shape and a floating-point dtype (integer weights would load as their raw quantized codes)."""
    missing = wanted.keys() - state.keys()
    unexpected = {k for k in state.keys() - wanted.keys() if not k.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        raise UnsupportedModelError(f"{source} does not match {arch}: missing {sorted(missing)[:5]}, "
                                    f"unexpected {sorted(unexpected)[:5]}")
    shapes = sorted(f"{k} {tuple(state[k].shape)}, expected {tuple(v.shape)}" for k, v in wanted.items()
                    if state[k].shape != v.shape)
    if shapes:
        raise UnsupportedModelError(f"{source}: tensor shapes do not match its config: {'; '.join(shapes[:3])}")
    ints = sorted(f"{k} {str(state[k].dtype).removeprefix('torch.')}" for k in wanted
                  if not state[k].is_floating_point())
    if ints:
        raise UnsupportedModelError(f"{source}: weights must be floating point (quantized integer weights are not "
                                    f"supported), got {'; '.join(ints[:3])}")


def _from_hf_folder(path: Path, name: str, dtype, device) -> LoadedModel:
    from specdec.loading.hf import read_hf_config, read_hf_state_dict, read_hf_tokenizer

    cfg = ModelConfig.from_hf(read_hf_config(path))
    model = build_model(cfg, read_hf_state_dict(path), dtype, device, source=path)
    return LoadedModel(name, model, read_hf_tokenizer(path), cfg)


def _from_gguf(path: Path, name: str, dtype, device) -> LoadedModel:
    from specdec.loading.gguf_loader import load_gguf, load_gguf_tokenizer

    ckpt = load_gguf(path)
    cfg = ModelConfig.from_hf(ckpt.hf_config)
    model = build_model(cfg, ckpt.state_dict, dtype, device, source=path)
    try:
        tok = _cached_gguf_tokenizer(path, load_gguf_tokenizer)
    except Exception as err:  # transformers' GGUF conversion raises ValueError, KeyError, ... on odd metadata
        raise unreadable(path, "cannot build the tokenizer from its tokenizer.ggml.* metadata", err) from err
    return LoadedModel(name, model, tok, cfg)


def _cached_gguf_tokenizer(path: Path, convert):
    """transformers converts a GGUF vocabulary slowly (~7 s); keep the converted tokenizer on disk.

    The cache key is the file's absolute path, size and mtime; set SPECDEC_CACHE to move it.
    """
    import hashlib
    import os

    from transformers import AutoTokenizer

    st = Path(path).stat()
    key = hashlib.sha1(f"{Path(path).resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))
    folder = root / "tokenizers" / key
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tok = convert(path)
    try:
        tok.save_pretrained(str(folder))
    except OSError:
        pass  # a read-only home only costs the next load the conversion again
    return tok


def truncate_layers(base: LoadedModel, num_layers: int) -> LoadedModel:
    """A draft made of the first ``num_layers`` layers of ``base`` (weights shared, not copied)."""
    if not 1 <= num_layers <= base.config.num_layers:
        raise ValueError(f"num_layers must be in [1, {base.config.num_layers}], got {num_layers}")
    from dataclasses import replace

    cfg = replace(base.config, num_layers=num_layers)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    src = base.model
    model.model.embed_tokens = src.model.embed_tokens
    model.model.layers = torch.nn.ModuleList(list(src.model.layers)[:num_layers])
    model.model.norm = src.model.norm
    model.lm_head = src.lm_head
    model.rope = src.rope
    return LoadedModel(f"{base.name}[:{num_layers}]", model.eval(), base.tokenizer, cfg)
