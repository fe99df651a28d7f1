"""Warm starts (``specdec distill --kind eagle --init-from DRAFT``): training begins from a trained eagle draft's
weights and keeps its draft vocabulary and feature layers.

``load_init`` reads the draft (a folder or a registered name) and checks that it was trained on the target being
trained: the target its record names, and, as the loader does, the fingerprints of the shared tensors.
``settle_config`` fills the run's draft vocabulary size and feature layers from it, refusing others; ``init_record``
is what the new record says of it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specdec.models.eagle import EagleShape

SUMMARY_KEYS = ("steps", "tokens_seen", "train_seconds", "loss", "tokens_file", "device", "options")


@dataclass(frozen=True)
class InitDraft:
    """A trained eagle draft to start from: the name given, its folder and metadata (its training record included),
    its own tensors in float32, its vocabulary map (N,) and the sha256 of its ``model.safetensors``."""

    name: str
    folder: Path
    meta: dict
    state: dict[str, torch.Tensor]
    vocab_ids: torch.Tensor
    sha256: str

    @property
    def shape(self) -> EagleShape:
        return EagleShape(tuple(self.meta["aux_layers"]), int(self.meta["draft_vocab"]))


def draft_folder(name: str) -> Path:
    """The folder of draft ``name``: the shipped default draft's for its registered name, else ``name`` as a path."""
    from specdec.loading.default_draft import DEFAULT_DRAFT_DIR, DEFAULT_DRAFT_NAME

    return DEFAULT_DRAFT_DIR if name == DEFAULT_DRAFT_NAME else Path(name).expanduser()


def load_init(name: str, target, target_ref: str) -> InitDraft:
    """The eagle draft ``name`` to start training from, on the loaded ``target`` (``target_ref``: the target the new
    draft's folder will name). ValueError when it is no eagle draft, or when its record names another target or its
    shared tensors or shape do not fit ``target`` (the message names the draft's target and this one)."""
    from safetensors.torch import load_file

    from specdec.loading.default_draft import read_draft_meta
    from specdec.loading.draft_format import check_shared

    folder = draft_folder(name)
    meta = read_draft_meta(folder)
    if meta.get("kind") != "eagle":
        raise ValueError(f"--init-from {name}: {folder} is a {meta.get('kind', 'layer-copy')} draft, not an eagle "
                         "draft")
    if meta["target"] != target_ref:
        raise ValueError(f"--init-from {name} was trained for target {meta['target']!r}, not {target_ref!r} (if "
                         f"{target_ref!r} is that model, say so with --target-name {meta['target']})")
    weights = folder / "model.safetensors"
    own = load_file(str(weights))
    target_state = target.model.state_dict()
    init = InitDraft(name, folder, meta, {k: v.float() for k, v in own.items() if k != "vocab_ids"},
                     own["vocab_ids"].to(torch.int64), hashlib.sha256(weights.read_bytes()).hexdigest())
    try:
        for key in meta["shared"]:
            check_shared(folder, key, target_state.get(key), meta["shared_fingerprint"][key], target.name)
        init.shape.check(target.config)
    except ValueError as err:
        raise ValueError(f"--init-from {name} was trained for target {meta['target']!r}, which is not the target "
                         f"trained here ({target.name!r}): {err}") from None
    return init


def settle_config(cfg, init: InitDraft):
    """``cfg`` (an ``EagleTrainConfig``) with ``init``'s draft vocabulary size and feature layers; ValueError naming
    both values when ``cfg`` asks for others."""
    kept = {"draft_vocab": init.shape.draft_vocab, "aux_layers": init.shape.aux_layers}
    for name, value in kept.items():
        asked = getattr(cfg, name)
        if asked is not None and asked != value:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {_text(asked)} conflicts with --init-from {init.name}, whose {name} is "
                             f"{_text(value)}: a warm start keeps the draft's (leave {flag} out)")
    return replace(cfg, **kept)


def _text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def init_record(init: InitDraft) -> dict:
    """What a warm-started draft's record says of the draft it started from: the name given, the file digest, the
    target, shape and a summary of its own training record (options, length, last validation, last measurement)."""
    rec = init.meta.get("training", {})
    summary = {k: rec[k] for k in SUMMARY_KEYS if k in rec}
    if "data" in rec:
        summary["data"] = rec["data"].get("source")
    if rec.get("val"):
        summary["val"] = rec["val"][-1]
    if rec.get("init_from"):
        summary["init_from"] = rec["init_from"]["name"]
    if rec.get("measured"):
        summary["measured"] = [{k: r[k] for k in ("set", "temperature", "tree", "mean_accepted_length") if k in r}
                               for r in rec["measured"][-1]["results"]]
    return {"name": init.name, "sha256": init.sha256, "target": init.meta["target"],
            "aux_layers": list(init.shape.aux_layers), "draft_vocab": init.shape.draft_vocab, "training": summary}
