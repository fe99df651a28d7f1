"""A draft built from a target: a few of its decoder layers, its final norm, its embeddings and head.

Only the decoder layers and the final norm are the draft's own (trained) parameters; the token
embeddings and LM head are the target's tensors, shared by reference, so a stored draft holds
just the trained part and a folder never duplicates the vocabulary-sized matrices.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from specdec.loading.base import LoadedModel
from specdec.models.llama import LlamaForCausalLM
from specdec.models.rope import RotaryEmbedding

TRAINED_PREFIXES = ("model.layers.", "model.norm.")


def target_layer_map(num_target_layers: int, num_layers: int, explicit: tuple[int, ...] | None = None
                     ) -> list[int]:
    """The target layers a draft starts from: ``explicit`` (checked), else evenly spaced indices
    that always include the first and, for >= 2 layers, the last.

    The first layer reads the raw embeddings and the last writes what the final norm and LM head
    expect, so a draft that starts with both has the right interfaces at either end.
    """
    if not 1 <= num_layers <= num_target_layers:
        raise ValueError(f"layers must be in [1, {num_target_layers}] (the target's layer count), "
                         f"got {num_layers}")
    if explicit is not None:
        if len(explicit) != num_layers or not all(0 <= i < num_target_layers for i in explicit):
            raise ValueError(f"init_layers must be {num_layers} indices in [0, {num_target_layers}), "
                             f"got {list(explicit)}")
        return list(explicit)
    if num_layers == 1:
        return [0]
    return [round(i * (num_target_layers - 1) / (num_layers - 1)) for i in range(num_layers)]


def shared_keys(tied: bool) -> list[str]:
    """State-dict names a draft shares with its target (the LM head only when untied)."""
    return ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])


def draft_from_target(target: LoadedModel, layers: list[int], name: str = "draft") -> LoadedModel:
    """A trainable draft: copies of ``target``'s decoder ``layers`` (in that order) and final norm.

    The copies are float32 with ``requires_grad``; embeddings and LM head are ``target``'s own
    modules (frozen, shared). The draft's layer j attends through KV index j.
    """
    cfg = replace(target.config, num_layers=len(layers))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    src = target.model
    model.model.embed_tokens = src.model.embed_tokens
    model.lm_head = src.lm_head
    copies = []
    for j, i in enumerate(layers):
        layer = copy.deepcopy(src.model.layers[i]).float()
        layer.self_attn.layer = j
        copies.append(layer)
    model.model.layers = torch.nn.ModuleList(copies)
    model.model.norm = copy.deepcopy(src.model.norm).float()
    model.rope = RotaryEmbedding(cfg).to(target.device)
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith(TRAINED_PREFIXES))
    return LoadedModel(name, model, target.tokenizer, cfg)


def trained_state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The draft's own parameters (decoder layers + final norm), detached, keyed by HF name."""
    return {n: p.detach() for n, p in model.named_parameters() if n.startswith(TRAINED_PREFIXES)}
