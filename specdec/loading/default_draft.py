"""Trained draft models: the shipped default draft and folders written by ``specdec distill``.

``load_draft_folder(path, dtype, device, target=None)`` loads any draft folder (one with a
``specdec_draft.json``); ``load_default_draft`` loads the one shipped as package data in
``specdec/drafts/smollm2-135m-draft/`` for the ``smollm2-135m`` target.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.loading.draft_folder import DRAFT_META, is_draft_folder, load_draft_folder, read_draft_meta
from specdec.loading.errors import ModelNotFoundError

DEFAULT_DRAFT_NAME = "smollm2-135m-draft"
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parents[1] / "drafts" / DEFAULT_DRAFT_NAME

__all__ = ["DEFAULT_DRAFT_DIR", "DEFAULT_DRAFT_NAME", "DRAFT_META", "default_draft_available",
           "is_draft_folder", "load_default_draft", "load_draft_folder", "read_draft_meta"]


def default_draft_available() -> bool:
    """True when the shipped default draft (metadata and weights) is installed."""
    return all((DEFAULT_DRAFT_DIR / f).is_file() for f in (DRAFT_META, "model.safetensors"))


def load_default_draft(dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
                       target=None):
    """The shipped ``smollm2-135m-draft`` as a ``LoadedModel``; ``target`` as in ``load_draft_folder``.

    Raises ``ModelNotFoundError`` (saying how to produce one) when it is not installed.
    """
    if not default_draft_available():
        raise ModelNotFoundError(
            f"the default draft {DEFAULT_DRAFT_NAME!r} is not installed (expected a trained draft folder "
            f"at {DEFAULT_DRAFT_DIR}); train one with `specdec distill --target smollm2-135m --out DIR` and "
            f"pass DIR as the draft, or use draft='ngram'")
    model = load_draft_folder(DEFAULT_DRAFT_DIR, dtype=dtype, device=device, target=target)
    model.name = DEFAULT_DRAFT_NAME
    return model
