"""Errors raised while locating and loading checkpoints."""

from __future__ import annotations

from pathlib import Path


class UnsupportedModelError(ValueError):
    """The checkpoint exists but uses an architecture, tensor or format this engine cannot load."""


class ModelNotFoundError(FileNotFoundError):
    """The requested checkpoint (file, folder or packaged model) does not exist."""


def unreadable(path: str | Path, what: str, err: BaseException) -> UnsupportedModelError:
    """The error for a file a library (transformers, safetensors) refused: ``path: what (its message)``, on one
    line (library messages often span several)."""
    return UnsupportedModelError(f"{path}: {what} ({' '.join(str(err).split())})")
