"""``load_model``: every model name -> a ready ``LoadedModel``.

Base models (``smollm2-135m``, Hugging Face folders, GGUF files) load through ``specdec.loading.base``;
the draft folders written by ``specdec distill`` and the shipped default draft through
``specdec.loading.default_draft``, which loads a draft's target with ``load_base_model`` (so no import circle).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.loading.base import (
    DTYPES,
    LoadedModel,
    build_model,
    load_base_model,
    local_path,
    model_name,
    resolve_dtype,
    truncate_layers,
)

__all__ = ["DTYPES", "LoadedModel", "build_model", "load_base_model", "load_model", "resolve_dtype",
           "truncate_layers"]


def load_model(
    name_or_path: str | Path, dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
    target: LoadedModel | None = None,
) -> LoadedModel:
    """Load ``smollm2-135m``, a registered draft name, a draft folder, a Hugging Face folder or a GGUF file.

    A draft (the registered name or a draft folder) takes its shared tensors from ``target`` when
    given, else loads the target recorded in its folder."""
    dtype = resolve_dtype(dtype)
    name = model_name(name_or_path)
    if name == "smollm2-135m-draft":
        from specdec.loading.default_draft import load_default_draft

        return load_default_draft(dtype=dtype, device=device, target=target)
    path = local_path(name)
    if path.is_dir():
        from specdec.loading.default_draft import is_draft_folder, load_draft_folder

        if is_draft_folder(path):
            return load_draft_folder(path, dtype=dtype, device=device, target=target)
    return load_base_model(name_or_path, dtype, device)
