"""What every draft folder shares: the metadata file name, its format tag, and the fingerprints of the
tensors a draft takes from its target (checked when loading, so a draft never runs on the wrong target).

Both the plain draft folders (``specdec.loading.draft_folder``) and eagle folders
(``specdec.loading.eagle_folder``) use these.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.loading.errors import UnsupportedModelError

DRAFT_META = "specdec_draft.json"
FORMAT = "specdec-draft"
VERSION = 1


def fingerprint(t: torch.Tensor) -> dict:
    """The shape and mean absolute value of ``t``, recorded for a shared tensor when a draft is saved."""
    return {"shape": list(t.shape), "abs_mean": float(t.detach().float().abs().mean())}


def check_shared(path: Path, key: str, tensor: torch.Tensor | None, want: dict, target_name: str) -> None:
    """UnsupportedModelError unless ``tensor`` (the target's ``key``) matches fingerprint ``want``."""
    if tensor is None or list(tensor.shape) != want["shape"]:
        got = None if tensor is None else list(tensor.shape)
        raise UnsupportedModelError(f"draft {path} needs {key} of shape {want['shape']} from its target; "
                                    f"target {target_name!r} has {got}")
    mean = float(tensor.float().abs().mean())
    if abs(mean - want["abs_mean"]) > 1e-2 * abs(want["abs_mean"]) + 1e-6:
        raise UnsupportedModelError(f"draft {path} was trained against other {key} values (|w| mean "
                                    f"{want['abs_mean']:.6g}) than target {target_name!r} has ({mean:.6g})")
