"""Megatron-style tensor parallelism of a Llama-family model over ``torch.distributed`` (docs/parallel.md).

Rank r of N keeps its query heads' rows of q_proj, its KV heads' rows of k/v_proj, its slice of the
intermediate rows of gate/up_proj, the matching columns of o_proj and down_proj (each followed by an
all-reduce) and 1/N of the vocabulary rows of the embedding and the LM head (an all-reduce, an all-gather).
The rank's module is an ordinary ``LlamaForCausalLM`` of the rank's shape with those three kinds of modules
swapped in, so attention, ``fuse`` and the backends run unchanged on fewer heads.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from specdec.config import ModelConfig
from specdec.errors import FieldError
from specdec.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``, collectives over ``group``
    (None: the default process group)."""

    rank: int
    size: int
    group: Any = None

    @classmethod
    def current(cls, size: int, group: Any = None) -> TensorParallel:
        """The group of ``size`` ranks this process belongs to; FieldError when no process group of that size
        is running (start one first: ``torchrun --nproc-per-node N`` and ``init_process_group``)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise FieldError("SpecConfig", "tensor_parallel_size", "> 1 needs a torch.distributed process group "
                             "(launch with torchrun --nproc-per-node N and call init_process_group first)", size)
        world = dist.get_world_size(group)
        if world != size:
            raise FieldError("SpecConfig", "tensor_parallel_size", f"must equal the process group's size ({world})",
                             size)
        return cls(dist.get_rank(group), size, group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place; every rank gets the same bytes."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:  # (..., n) -> (..., size * n)
        """Every rank's ``x`` side by side in the last dimension, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, -1)


def check_split(cfg: ModelConfig, size: int, role: str = "target") -> None:
    """FieldError naming ``tensor_parallel_size`` and the model's numbers when ``cfg`` cannot be split over
    ``size`` ranks: query heads and the intermediate size must divide by it, and KV heads must divide by it or
    divide it (then each KV head is replicated on ``size / num_kv_heads`` ranks)."""
    nh, nkv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if nh % size or inter % size or (nkv % size and size % nkv):
        raise FieldError("SpecConfig", "tensor_parallel_size", f"must divide the {role}'s num_heads ({nh}) and "
                         f"intermediate_size ({inter}), and divide or be a multiple of its num_kv_heads ({nkv})",
                         size)


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shape of one rank's model: heads, KV heads and intermediate size split, the rest whole."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=max(1, cfg.num_kv_heads // size),
                               intermediate_size=cfg.intermediate_size // size)


def kv_heads_of(cfg: ModelConfig, rank: int, size: int) -> range:
    """The KV heads rank ``rank`` of ``size`` holds (one replicated head when ranks outnumber KV heads)."""
    if cfg.num_kv_heads >= size:
        per = cfg.num_kv_heads // size
        return range(rank * per, (rank + 1) * per)
    head = rank // (size // cfg.num_kv_heads)
    return range(head, head + 1)


def vocab_rows(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """(first row, rows per rank): rank ``rank`` holds vocabulary rows [first, first + per), zero-padded past
    ``vocab_size``."""
    per = -(-vocab_size // size)
    return rank * per, per


class RowParallelLinear(nn.Linear):
    """A linear layer over this rank's input columns (no bias), its partial outputs summed over the ranks."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in / N) -> (T, out)
        return self.tp.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``[start, start + per)`` of the embedding table; ids outside them embed as zeros, and
    the sum over the ranks is the whole table's embedding."""

    def __init__(self, per: int, hidden: int, start: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(per, hidden))
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        local = ids - self.start  # (T,)
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)  # (T, hidden)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))


class VocabParallelHead(nn.Module):
    """This rank's vocabulary rows of the LM head; the ranks' logits gathered into the whole (T, V)."""

    def __init__(self, per: int, hidden: int, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(per, hidden))
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, V)
        local = nn.functional.linear(hidden, self.weight)  # (T, per)
        return self.tp.all_gather_last(local)[:, :self.vocab_size]


_LAYER = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)$")


def shard_state(cfg: ModelConfig, state: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slices of a whole model's ``state`` (Hugging Face names, ``cfg``'s shapes) for ``size``
    ranks; the norms whole. ``check_split`` first."""
    check_split(cfg, size)
    d, nh_r = cfg.head_dim, cfg.num_heads // size
    kv = kv_heads_of(cfg, rank, size)
    inter_r = cfg.intermediate_size // size
    start, per = vocab_rows(cfg.vocab_size, rank, size)
    rows = {"q": slice(rank * nh_r * d, (rank + 1) * nh_r * d), "k": slice(kv.start * d, kv.stop * d),
            "gate": slice(rank * inter_r, (rank + 1) * inter_r)}
    rows["v"], rows["up"] = rows["k"], rows["gate"]
    cols = {"o": rows["q"], "down": rows["gate"]}
    out = {}
    for name, w in state.items():
        m = _LAYER.search(name)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = _pad_rows(w[start:start + per], per)  # (per, hidden)
        elif m and m.group(2) in rows:
            w = w[rows[m.group(2)]]
        elif m and m.group(2) in cols:
            w = w[:, cols[m.group(2)]]
        out[name] = w.contiguous()
    return out


def shard_model(model: LlamaForCausalLM, tp: TensorParallel) -> LlamaForCausalLM:
    """A new ``LlamaForCausalLM`` holding rank ``tp.rank``'s part of ``model`` (slices of its tensors), whose
    forward and ``compute_logits`` give the whole model's results on every rank when all ranks run it on the
    same inputs. Its ``config`` is the rank's shape, ``full_config`` the whole model's."""
    cfg = model.config
    check_split(cfg, tp.size)
    state = shard_state(cfg, model.state_dict(), tp.rank, tp.size)
    with torch.device("meta"):
        part = LlamaForCausalLM(local_config(cfg, tp.size))
        _swap_parallel_modules(part, cfg, tp)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    part.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        part.lm_head.weight = part.model.embed_tokens.weight
    part.rope = model.rope  # (the whole model's tables: rope is per head, the same on every rank)
    part.full_config = cfg
    return part.eval().requires_grad_(False)


def _swap_parallel_modules(part: LlamaForCausalLM, cfg: ModelConfig, tp: TensorParallel) -> None:
    """Give ``part`` (built from the local config) its row-parallel projections and vocabulary-parallel ends."""
    local = part.config
    for layer in part.model.layers:
        layer.self_attn.o_proj = RowParallelLinear(local.num_heads * local.head_dim, cfg.hidden_size, tp)
        layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, cfg.hidden_size, tp)
    start, per = vocab_rows(cfg.vocab_size, tp.rank, tp.size)
    part.model.embed_tokens = VocabParallelEmbedding(per, cfg.hidden_size, start, tp)
    part.lm_head = VocabParallelHead(per, cfg.hidden_size, cfg.vocab_size, tp)


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """``w`` with zero rows appended up to ``rows`` rows."""
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])
