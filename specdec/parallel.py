"""The engine's side of tensor parallelism (docs/parallel.md): what a ``tensor_parallel_size`` > 1 engine
supports, and this rank's part of the target.

Every rank builds the same engine and is driven with the same requests in the same order; the scheduler,
the allocator, the prefix cache and the stop checks are deterministic, and every rank's logits are the same
bytes after the collectives, so every rank schedules the same batches and commits the same tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from specdec.errors import FieldError
from specdec.loading.base import LoadedModel
from specdec.models.eagle import EagleDraft
from specdec.models.llama import LlamaForCausalLM
from specdec.models.tensor_parallel import TensorParallel, check_split, shard_model


def shard_models(target: LoadedModel, draft: LoadedModel | None, cfg,
                 device: torch.device | None = None) -> tuple[LoadedModel, LoadedModel | None]:
    """This rank's parts of ``target`` and of the ``draft`` (None: target-only or n-gram) for an engine with
    options ``cfg`` (a SpecConfig with ``tensor_parallel_size`` > 1): a Llama draft model is sharded like the
    target, an EAGLE draft is kept whole on every rank (one decoder layer: it reads the target's features, which
    are the residual stream and so the same bytes on every rank after the row-parallel all-reduces, and every rank
    runs the same draft on the same inputs, so every rank proposes the same trees). Each part's ``config`` is the
    rank's shape (its KV heads size the pool), moved to ``device`` when given (only the rank's part of a model
    loaded on the CPU reaches its GPU). FieldError naming ``tensor_parallel_size`` when the combination is not
    supported or a model does not split; also seeds torch's global RNG from rank 0 (``sync_global_seed``)."""
    size = cfg.tensor_parallel_size
    _check_supported(cfg)
    for role, loaded in (("target", target), ("draft", draft)):
        if loaded is not None and not isinstance(loaded.model, LlamaForCausalLM) and not (
                role == "draft" and isinstance(loaded.model, EagleDraft)):
            raise FieldError("SpecConfig", "tensor_parallel_size", f"> 1 needs a Llama-family {role} (or, as the "
                             f"draft, an EAGLE draft), got {type(loaded.model).__name__}", size)
    tp = TensorParallel.current(size)
    _check_backend(cfg, tp)
    _control_group(tp)  # (made now, on every rank alike: making a group is a collective)
    part = _shard(target, tp, "target")
    if draft is not None and isinstance(draft.model, LlamaForCausalLM):
        draft = _shard(draft, tp, "draft")
    if device is not None:
        for loaded in (part, draft):
            if loaded is not None:
                loaded.model.to(device)
    sync_global_seed(tp)
    return part, draft


def _shard(loaded: LoadedModel, tp: TensorParallel, role: str) -> LoadedModel:
    check_split(loaded.config, tp.size, role)
    part = shard_model(loaded.model, tp)
    return LoadedModel(loaded.name, part, loaded.tokenizer, part.config)


def free_port() -> int:
    """A free TCP port on this host, for a local group's rendezvous (``MASTER_PORT``, ``tcp://127.0.0.1:PORT``)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_local_group(rank: int, size: int, port: int, device: str) -> str:
    """Join a group of ``size`` processes on this host as ``rank`` (rendezvous at ``port``): NCCL with this rank on
    GPU K + rank when ``device`` is cuda:K (made current), gloo on the CPU. Returns this rank's device."""
    dev = torch.device(device)
    if dev.type == "cuda":
        index = (dev.index or 0) + rank
        torch.cuda.set_device(index)
        device = f"cuda:{index}"
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size)
    return device


def sync_global_seed(tp: TensorParallel) -> None:
    """Seed torch's global RNG on every rank with a seed drawn on rank 0: an unseeded sampled request draws its
    seed from it (``verifier.request_stream``), and every rank draws in the same order, so the ranks'
    requests get the same seeds."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    dist.broadcast(seed, src=0, group=_control_group(tp))
    torch.manual_seed(int(seed.item()))


def from_rank0(values: list[int], size: int) -> list[int]:
    """Rank 0's ``values`` (small ints) on every rank of the group of ``size``: a decision each rank could make
    differently (from its own timings) made alike, as rank 0 made it."""
    x = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(x, src=0, group=control_group(size))
    return x.tolist()


def agree_min(value: int, size: int) -> int:
    """The least of every rank's ``value`` (the group of ``size`` ranks this process belongs to): what each rank
    sizes alike from what it measured on its own (the KV pool from its GPU's free memory), so that every rank has
    the same blocks and schedules the same batches."""
    x = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(x, op=dist.ReduceOp.MIN, group=control_group(size))
    return int(x.item())


def control_group(size: int):
    """The group of ``size`` ranks' channel for the host's small messages (``_control_group``): a tensor-parallel
    server's operations go through it."""
    return _control_group(TensorParallel.current(size))


_CONTROL_GROUPS: dict = {}  # a tensor-parallel group (None: the default one) -> its ranks' gloo group


def _control_group(tp: TensorParallel):
    """The group the host's small messages go through (seeds, budgets, sizes): ``tp``'s own under gloo; under NCCL a
    gloo group of the same ranks, made once, so that such a message neither waits for the GPU's queued work (an
    NCCL collective is ordered behind the current stream's, a pipelined engine's next step included) nor costs a
    copy to the GPU and back."""
    if dist.get_backend(tp.group) == "gloo":
        return tp.group
    if tp.group not in _CONTROL_GROUPS:
        ranks = None if tp.group is None else dist.get_process_group_ranks(tp.group)
        _CONTROL_GROUPS[tp.group] = dist.new_group(ranks, backend="gloo")
    return _CONTROL_GROUPS[tp.group]


def _refuse(cfg, why: str) -> None:
    raise FieldError("SpecConfig", "tensor_parallel_size", f"> 1 {why}", cfg.tensor_parallel_size)


def _check_supported(cfg) -> None:
    """FieldError for what a tensor-parallel engine cannot do yet: a device other than the CPU or CUDA, and the
    per-step budget controller (``adaptive=True``), whose choices come from each rank's own step timings and would
    need a broadcast every step (the plan's auto controller under tensor parallelism is a pipelined engine's
    ``EpochBudget``, whose choices are rank 0's, broadcast once an epoch ends)."""
    if torch.device(cfg.device).type not in ("cpu", "cuda"):
        _refuse(cfg, f"runs on the CPU (gloo) or CUDA (NCCL), got device {cfg.device!r}")
    if cfg.adaptive:
        _refuse(cfg, "does not support adaptive=True yet (each rank would choose budgets from its own timings)")


def _check_backend(cfg, tp: TensorParallel) -> None:
    """FieldError unless the group's backend suits the device: NCCL for CUDA (each rank on its own GPU, made current
    by the launcher: ``torch.cuda.set_device(LOCAL_RANK)``), gloo for the CPU."""
    backend, cuda = dist.get_backend(tp.group), torch.device(cfg.device).type == "cuda"
    if cuda and backend != "nccl":
        _refuse(cfg, f"on CUDA needs an NCCL process group, got {backend!r}")
    if not cuda and backend != "gloo":
        _refuse(cfg, f"on the CPU needs a gloo process group, got {backend!r}")
