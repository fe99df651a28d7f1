"""A feature-conditioned (EAGLE-style) draft: one decoder layer over the target's own hidden states.

At position p the draft reads ``g`` (the fused outputs of a low, a middle and a high target layer
at position p - 1, or at deeper tree levels its own output at the parent) and the embedding of
token p, and predicts token p + 1 over a reduced vocabulary: the ``N`` most frequent target
tokens, mapped back to target ids (any other token has draft probability 0). Its KV layout is
one Llama layer with the target's heads, so it lives in the shared pool as an ordinary model.

The token embeddings and the LM head rows are the target's, frozen; only the fusion, the input
projection, the decoder layer and the norms are trained (and stored).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from specdec.config import ModelConfig
from specdec.kernels.norm_act import add_rmsnorm, embed_feature_norm
from specdec.models.llama import DecoderLayer, ForwardContext, LlamaForCausalLM, RMSNorm
from specdec.models.rope import RotaryEmbedding

TRAINED_PREFIXES = ("fc.", "in_proj.", "embed_norm.", "feature_norm.", "layer.", "norm.")


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Target layers whose outputs the draft reads: low, middle and high, e.g. (2, 15, 27) of 30."""
    if num_layers >= 6:
        return (2, num_layers // 2, num_layers - 3)
    return tuple(sorted({0, num_layers // 2, num_layers - 1}))


@dataclass(frozen=True)
class EagleShape:
    """What fixes an eagle draft's tensors besides the target: feature layers and draft vocab size."""

    aux_layers: tuple[int, ...]
    draft_vocab: int

    def check(self, target: ModelConfig) -> None:
        """Raise ValueError naming the field when this shape cannot sit on ``target``."""
        layers = list(self.aux_layers)
        if not layers or layers != sorted(set(layers)) or not all(0 <= i < target.num_layers for i in layers):
            raise ValueError(f"aux_layers must be distinct increasing target layers in [0, {target.num_layers}), "
                             f"got {layers}")
        if not 1 <= self.draft_vocab <= target.vocab_size:
            raise ValueError(f"draft_vocab must be in [1, {target.vocab_size}] (the target's vocabulary), "
                             f"got {self.draft_vocab}")


class EagleDraft(nn.Module):
    """The draft module. ``forward`` gives its hidden states (T, hidden), which are both the input
    of ``compute_logits`` and the feature ``g`` of its children."""

    reads_features = True  # forward takes a feature row per token (graph capture gives it an input buffer)

    def __init__(self, target_cfg: ModelConfig, shape: EagleShape) -> None:
        super().__init__()
        shape.check(target_cfg)
        h, eps = target_cfg.hidden_size, target_cfg.rms_norm_eps
        self.config = replace(target_cfg, num_layers=1)
        self.aux_layers = tuple(shape.aux_layers)
        self.embed_tokens = nn.Embedding(target_cfg.vocab_size, h)
        self.fc = nn.Linear(len(shape.aux_layers) * h, h, bias=False)
        self.embed_norm = RMSNorm(h, eps)
        self.feature_norm = RMSNorm(h, eps)
        self.in_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(self.config, 0)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, shape.draft_vocab, bias=False)
        self.register_buffer("vocab_ids", torch.zeros(shape.draft_vocab, dtype=torch.int64))
        self.rope = RotaryEmbedding(self.config)

    @property
    def shape(self) -> EagleShape:
        return EagleShape(self.aux_layers, self.lm_head.out_features)

    def fuse_projections(self) -> EagleDraft:
        """Fuse its decoder layer's q/k/v and gate/up projections for inference, like
        ``LlamaForCausalLM.fuse``: one GEMM each instead of three and two, and the fused SiLU-mul op
        (the projections stay views, so state_dict and training, which uses them, are unchanged)."""
        self.layer.self_attn.fuse()
        self.layer.mlp.fuse()
        return self

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """Target features (T, k * hidden) -> ``g`` (T, hidden); each layer's part is RMS-scaled first."""
        t, h = aux.shape[0], self.fc.out_features
        parts = aux.view(t, -1, h).float()  # (T, k, hidden)
        parts = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return self.fc(parts.flatten(1).to(self.fc.weight.dtype))  # (T, hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                g: torch.Tensor) -> torch.Tensor:
        """Hidden states (T, hidden) for tokens ``input_ids`` (T,) given their features ``g`` (T, hidden)."""
        out, residual = self._layer(input_ids, positions, ctx, g)  # the layer's output is out + residual
        return out + residual

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                       g: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(``forward``, ``compute_logits(forward, ctx.backend, dtype)``) with the layer's last add inside the
        final norm (``add_rmsnorm`` of out and residual gives both): one launch fewer, the same values."""
        out, residual = self._layer(input_ids, positions, ctx, g)
        normed, hidden = add_rmsnorm(out, residual, self.norm.weight, self.norm.eps, use_triton=ctx.backend.uses_triton)
        logits = self.lm_head(normed)
        return hidden, logits if dtype is None else logits.to(dtype)

    def _layer(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
               g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layer's (out, residual) (T, hidden) each: ``forward`` is their sum."""
        # the embedding row and both norms: one launch on the Triton backend, the autograd reference in training
        x = self.in_proj(embed_feature_norm(input_ids, self.embed_tokens.weight, g, self.embed_norm.weight,
                                            self.feature_norm.weight, self.embed_norm.eps, self.feature_norm.eps,
                                            use_triton=ctx.backend.uses_triton))  # (T, hidden)
        ctx.rope_cs = self.rope.gather(positions) if ctx.backend.wants_rope_tables else None
        return self.layer(x, None, positions, self.rope, ctx)

    def compute_logits(self, hidden: torch.Tensor, backend=None,
                       dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Logits over the draft vocabulary (T, N) in ``dtype`` (None: the head's own, no cast launch);
        ``backend``: whose norm to use (the device programs pass theirs, so on the Triton backend the fused norm
        replaces ~7 small kernels)."""
        if backend is None:
            normed = self.norm(hidden)
        else:
            normed = add_rmsnorm(hidden, None, self.norm.weight, self.norm.eps, use_triton=backend.uses_triton)[0]
        logits = self.lm_head(normed)
        return logits if dtype is None else logits.to(dtype)

    def full_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-vocabulary logits (T, N) spread over the target vocabulary (T, V); -inf elsewhere."""
        out = logits.new_full((logits.shape[0], vocab_size), float("-inf"))  # (T, V)
        return out.index_copy_(1, self.vocab_ids, logits)


def trained_state(model: EagleDraft) -> dict[str, torch.Tensor]:
    """The draft's own tensors (trained parameters and the vocabulary map), detached, by name."""
    state = {n: p.detach() for n, p in model.named_parameters() if n.startswith(TRAINED_PREFIXES)}
    state["vocab_ids"] = model.vocab_ids.detach()
    return state


def eagle_from_target(target: LlamaForCausalLM, shape: EagleShape, vocab_ids: torch.Tensor,
                      state: dict[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None,
                      seed: int = 0, trainable: bool | None = None) -> EagleDraft:
    """An eagle draft on ``target``: embeddings shared (frozen), LM head = the target's rows
    ``vocab_ids`` (frozen), own tensors from ``state`` or freshly initialised (decoder layer copied
    from the target's last layer, projections random with ``seed``). Own tensors are ``dtype``
    (default the target's) and require grad when ``trainable`` (default: only when freshly initialised)."""
    cfg = target.config
    vocab_ids = vocab_ids.to(torch.int64)
    if vocab_ids.numel() != shape.draft_vocab or vocab_ids.min() < 0 or vocab_ids.max() >= cfg.vocab_size:
        raise ValueError(f"vocab_ids must hold {shape.draft_vocab} target ids in [0, {cfg.vocab_size}), got "
                         f"{vocab_ids.numel()} ids in [{int(vocab_ids.min())}, {int(vocab_ids.max())}]")
    dev = target.lm_head.weight.device
    dtype = dtype or target.lm_head.weight.dtype
    with torch.device("meta"):
        model = EagleDraft(cfg, shape)
    model.embed_tokens = target.model.embed_tokens
    head = nn.Linear(cfg.hidden_size, shape.draft_vocab, bias=False, device=dev, dtype=target.lm_head.weight.dtype)
    head.weight = nn.Parameter(target.lm_head.weight.detach()[vocab_ids.to(dev)].clone(), requires_grad=False)
    model.lm_head = head
    model.vocab_ids = vocab_ids.to(dev)
    model.rope = RotaryEmbedding(model.config).to(dev)
    own = state if state is not None else _fresh_state(target, model, seed)
    trainable = state is None if trainable is None else trainable
    for name in [n for n, _ in model.named_parameters()]:
        if name.startswith(TRAINED_PREFIXES):
            _set_param(model, name, own[name].to(device=dev, dtype=dtype), trainable)
    return model


def _fresh_state(target: LlamaForCausalLM, model: EagleDraft, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = target.config.hidden_size
    last = {f"layer.{k}": v for k, v in target.model.layers[-1].state_dict().items()}
    return {
        **{k: v.detach().float().cpu() for k, v in last.items()},
        "fc.weight": torch.randn(model.fc.weight.shape, generator=g) * (model.fc.in_features ** -0.5),
        "in_proj.weight": torch.randn(model.in_proj.weight.shape, generator=g) * ((2 * h) ** -0.5),
        "embed_norm.weight": torch.ones(h), "feature_norm.weight": torch.ones(h),
        "norm.weight": target.model.norm.weight.detach().float().cpu(),
    }


def _set_param(model: nn.Module, name: str, value: torch.Tensor, trainable: bool) -> None:
    *path, leaf = name.split(".")
    owner = model
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, leaf, nn.Parameter(value.clone(), requires_grad=trainable))
