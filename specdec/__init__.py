"""specdec: lossless speculative decoding on one shared paged KV pool.

The names below load on first use (PEP 562), so ``specdec --help`` and other commands that load no model do not
import torch first; ``specdec.__version__`` is the installed distribution's.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {"SpecEngine": "specdec.engine", "SpecConfig": "specdec.engine", "LLM": "specdec.llm",
          "SamplingParams": "specdec.sampling_params", "RequestOutput": "specdec.outputs",
          "AcceptanceStats": "specdec.outputs", "load_model": "specdec.loading.registry",
          "LoadedModel": "specdec.loading.registry", "truncate_layers": "specdec.loading.registry"}

__all__ = ["SpecEngine", "LLM", "SpecConfig", "SamplingParams", "RequestOutput", "AcceptanceStats", "load_model",
           "LoadedModel", "truncate_layers"]

if TYPE_CHECKING:
    from specdec.engine import SpecConfig, SpecEngine
    from specdec.llm import LLM
    from specdec.loading.registry import LoadedModel, load_model, truncate_layers
    from specdec.outputs import AcceptanceStats, RequestOutput
    from specdec.sampling_params import SamplingParams


def _installed_version() -> str:
    """The installed distribution's version ("unknown (not installed)" in a source tree never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specdec")
    except PackageNotFoundError:
        return "unknown (not installed)"


def __getattr__(name: str):
    if name == "__version__":
        value = _installed_version()
    elif name not in _WHERE:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    else:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
