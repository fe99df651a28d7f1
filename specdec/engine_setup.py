"""What ``SpecEngine`` builds from its arguments before its first step: the models loaded and checked against each
other, the KV layout of each, the attention backend, the plan's proposer kind, and the drafter of target-only
decoding."""

from __future__ import annotations

import torch

from specdec.config import ModelConfig
from specdec.drafters.base import Drafter, Proposal
from specdec.kvcache.pool import KVSpec
from specdec.loading.registry import LoadedModel, load_model
from specdec.spec_config import SpecConfig


class NoDraft(Drafter):
    """Target-only decoding: empty trees, so each verify forward commits one token (pipelined, a step may adopt the
    decode the previous one queued on the device: ``specdec.pipeline``)."""

    @property
    def lookahead(self) -> int:
        """Pipelined, a step is queued before the previous one's bonus token is committed: one more slot."""
        return 1 if self.pipelined else 0

    def propose(self, rows):
        from specdec.tree import DraftTree

        return Proposal([DraftTree.empty("cpu") for _ in rows],
                        [None] * len(rows))


def as_loaded(model, dtype, device, target: LoadedModel | None = None) -> LoadedModel:
    """``model`` itself, or loaded; a draft folder shares its embeddings with ``target``."""
    if isinstance(model, LoadedModel):
        return model
    return load_model(model, dtype=dtype, device=device, target=target)


def kv_spec(cfg: ModelConfig) -> KVSpec:
    return KVSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)


def attention_backend(cfg: SpecConfig, device: torch.device):
    try:
        from specdec.kernels.backend import select_backend
    except ImportError:
        from specdec.attention.torch_backend import TorchAttentionBackend

        if cfg.attention_backend == "triton":
            raise
        return TorchAttentionBackend()
    return select_backend(device, cfg.attention_backend)


def proposer_kind(draft, loaded: LoadedModel | None) -> str:
    """The plan's proposer of a ``draft`` argument (``loaded``: the draft model it loaded, if any)."""
    if draft is None:
        return "none"
    if draft == "ngram":
        return "ngram"
    from specdec.models.eagle import EagleDraft

    return "eagle" if isinstance(loaded.model, EagleDraft) else "draft"


def feature_width(draft: LoadedModel | None, proposer: str) -> int:
    """Target features kept per KV slot (``KVPool.features``): what an EAGLE draft reads per position."""
    if proposer != "eagle":
        return 0
    model = draft.model
    return len(model.aux_layers) * model.config.hidden_size


def check_same_vocab(draft: LoadedModel, target: LoadedModel) -> None:
    """Refuse a draft whose tokenizer differs from the target's (a padded vocabulary is fine)."""
    dt, tt = draft.tokenizer, target.tokenizer
    if dt is None or tt is None:
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"draft vocab_size {draft.config.vocab_size} != target {target.config.vocab_size}")
        return
    dv, tv = dt.get_vocab(), tt.get_vocab()
    common = min(len(dv), len(tv))
    if any(dv.get(tok) != idx for tok, idx in tv.items() if idx < common) or max(len(dv), len(tv)) > max(
            draft.config.vocab_size, target.config.vocab_size):
        raise ValueError(f"draft {draft.name!r} and target {target.name!r} use different tokenizers; "
                         "speculative decoding needs the same vocabulary")
