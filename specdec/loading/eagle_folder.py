"""Eagle draft folders: ``model.safetensors`` (trained tensors + vocabulary map) and ``specdec_draft.json``.

The metadata says ``"kind": "eagle"``, the target reference, the feature layers and the draft
vocabulary size; the embeddings and LM head rows come from the target when loading, checked
against the fingerprints recorded at save time. No config or tokenizer files: both are the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdec.loading.base import LoadedModel
from specdec.loading.draft_format import DRAFT_META, FORMAT, VERSION, check_shared, fingerprint
from specdec.loading.draft_layers import shared_keys
from specdec.loading.errors import UnsupportedModelError
from specdec.models.eagle import EagleDraft, EagleShape, eagle_from_target, trained_state

KIND = "eagle"


def save_eagle_folder(out: str | Path, draft: EagleDraft, target: LoadedModel, target_ref: str, extra: dict,
                      save_dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``draft`` (trained on ``target``) to folder ``out``; returns its ``model.safetensors`` path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(save_dtype) if v.is_floating_point() else v).contiguous().cpu()
             for k, v in trained_state(draft).items()}
    weights = out / "model.safetensors"
    tmp = weights.with_suffix(".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(weights)
    shared = shared_keys(target.config.tie_word_embeddings)
    target_state = target.model.state_dict()
    meta = {"format": FORMAT, "version": VERSION, "kind": KIND, "target": target_ref,
            "aux_layers": list(draft.aux_layers), "draft_vocab": draft.lm_head.out_features, "shared": shared,
            "shared_fingerprint": {k: fingerprint(target_state[k]) for k in shared}, **extra}
    (out / DRAFT_META).write_text(json.dumps(meta, indent=1))
    return weights


def load_eagle_folder(path: Path, meta: dict, dtype: torch.dtype, device, target: LoadedModel) -> LoadedModel:
    """The eagle draft of folder ``path`` on ``target`` (its tensors in ``dtype`` on ``device``)."""
    own = load_file(str(path / "model.safetensors"))
    if "vocab_ids" not in own:
        raise UnsupportedModelError(f"{path}/model.safetensors has no vocab_ids (not an eagle draft)")
    target_state = target.model.state_dict()
    for key in meta["shared"]:
        check_shared(path, key, target_state.get(key), meta["shared_fingerprint"][key], target.name)
    shape = EagleShape(tuple(meta["aux_layers"]), int(meta["draft_vocab"]))
    try:
        shape.check(target.config)
    except ValueError as err:
        raise UnsupportedModelError(f"draft {path} does not fit target {target.name!r}: {err}") from None
    vocab_ids = own.pop("vocab_ids")
    model = eagle_from_target(target.model, shape, vocab_ids, state=own, dtype=dtype)
    model = model.to(device=device).eval().requires_grad_(False)
    return LoadedModel(str(path), model, target.tokenizer, model.config)
