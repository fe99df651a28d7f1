"""Errors raised while locating and loading checkpoints."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint exists but uses an architecture, tensor or format this engine cannot load."""


class ModelNotFoundError(FileNotFoundError):
    """The requested checkpoint (file, folder or packaged model) does not exist."""
