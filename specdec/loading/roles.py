"""Which model may be a target: an EAGLE-style draft reads its target's features and cannot run alone.

``check_roles(draft, target)`` refuses a draft given as the target (names, paths or loaded models) before
anything loads, saying which model is which."""

from __future__ import annotations

from pathlib import Path

from specdec.loading.base import LoadedModel, local_path


class ModelRoleError(ValueError):
    """A model was given where the other role belongs (e.g. an EAGLE draft as the target)."""


def eagle_draft_target(model) -> str | None:
    """The target recorded by an EAGLE-style draft (the shipped ``smollm2-135m-draft``, an eagle draft folder or
    a loaded EAGLE draft); None for anything else (a base model, a layer-copy draft, 'ngram', None)."""
    if isinstance(model, LoadedModel):
        from specdec.models.eagle import EagleDraft

        return "its target" if isinstance(model.model, EagleDraft) else None
    if not isinstance(model, (str, Path)):
        return None
    from specdec.loading.default_draft import DEFAULT_DRAFT_DIR, DEFAULT_DRAFT_NAME, is_draft_folder, read_draft_meta

    path = DEFAULT_DRAFT_DIR if str(model) == DEFAULT_DRAFT_NAME else local_path(str(model))
    if not is_draft_folder(path):
        return None
    meta = read_draft_meta(path)
    return str(meta.get("target", "its target")) if meta.get("kind") == "eagle" else None


def check_roles(draft, target) -> None:
    """Raise ModelRoleError when ``target`` is an EAGLE-style draft; the message says which model is the draft
    and which the target, and whether the two look swapped."""
    wanted = eagle_draft_target(target)
    if wanted is None:
        return
    name = getattr(target, "name", target)
    swapped = draft is not None and draft != "ngram" and eagle_draft_target(draft) is None
    fix = (f"the two look swapped: the draft is {name!r}, the target {getattr(draft, 'name', draft)!r}"
           if swapped else f"give it as the draft and {wanted!r} as the target")
    raise ModelRoleError(f"target {name!r} is an EAGLE-style draft model (it reads a target's features and "
                         f"cannot decode alone); {fix}")
