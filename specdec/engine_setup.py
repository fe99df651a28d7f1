"""What ``SpecEngine`` builds from its arguments before its first step: the models loaded and checked against each
other, the KV layout of each and the pool's size, the attention backend, the plan's proposer kind and its drafter
(``NoDraft`` for target-only decoding), the captured graphs, and the parts the plan wires into the step (the n-gram
device follow-up, the fused EAGLE verify, the overlap pipeline)."""

from __future__ import annotations

import contextlib
import time

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


def kv_budget(cfg: SpecConfig, device: torch.device, target: LoadedModel, draft: LoadedModel | None) -> int:
    """Bytes of KV pool when ``num_blocks`` is not given: ``kv_memory_bytes``, else on CUDA what
    ``gpu_memory_utilization`` leaves beside the models, else 256 MiB."""
    if cfg.kv_memory_bytes:
        return cfg.kv_memory_bytes
    if device.type == "cuda":
        from specdec.memory_budget import gpu_kv_budget

        models = [target.model] + ([draft.model] if draft is not None else [])
        return gpu_kv_budget(cfg.gpu_memory_utilization, device, models)
    return 256 << 20


def load_device(tensor_parallel_size: int, device):
    """Where an engine's models load: on ``device``, but on the CPU under tensor parallelism, where each rank then
    moves only its part to its device (``parallel.shard_models``), so a target larger than one GPU never sits whole
    on one."""
    return "cpu" if tensor_parallel_size > 1 else device


def on_device(device: torch.device):
    """The context of an engine's device work: on CUDA its GPU made current (CUDA graphs capture and replay on the
    current device's streams, and every new thread, a serving loop's included, starts on GPU 0), else nothing."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def agree_with_rank0(tensor_parallel_size: int):
    """What makes a rank's budget decisions rank 0's under tensor parallelism (``parallel.from_rank0``), or None."""
    if tensor_parallel_size == 1:
        return None
    from functools import partial

    from specdec.parallel import from_rank0

    return partial(from_rank0, size=tensor_parallel_size)


def make_drafter(draft, loaded: LoadedModel | None, cfg: SpecConfig, device: torch.device, runner,
                 target_vocab: int) -> Drafter:
    """The proposer of a ``draft`` argument (``loaded``: the draft model it loaded, if any): n-gram chains, an EAGLE
    draft, a Llama draft model, or none (``NoDraft``)."""
    spec = cfg.tree_spec
    if draft == "ngram":
        from specdec.drafters.ngram import NgramDrafter

        if spec.kind != "chain":
            raise ValueError(f"the n-gram drafter proposes chains: use tree='chain:K', got {spec}")
        return NgramDrafter(spec.k, cfg.ngram_max_n, device=device, shared=cfg.ngram_shared)
    if loaded is None:
        return NoDraft()
    from specdec.drafters.model_drafter import ModelDrafter
    from specdec.models.eagle import EagleDraft

    if isinstance(loaded.model, EagleDraft):
        from specdec.drafters.eagle_drafter import EagleDrafter

        return EagleDrafter(loaded.model, runner, spec, target_vocab)
    return ModelDrafter(loaded.model, runner, spec)


def setup_graphs(target: LoadedModel, draft: LoadedModel | None, drafter: Drafter, pool, runner, cfg: SpecConfig,
                 device: torch.device, bt_width: int, padded: bool):
    """Fuse the models' projections and, for padded steps (``plan.padded``), capture the graphed steps of every
    bucket (``graphs.GraphRunner``, which the runner and an EAGLE drafter's device loop replay); returns the
    capture report, or None."""
    from specdec.graphs import GraphRunner
    from specdec.models.llama import LlamaForCausalLM

    for m in (target, draft):
        if m is not None and isinstance(m.model, LlamaForCausalLM):
            m.model.fuse()
        elif m is not None and hasattr(m.model, "fuse_projections"):  # an EAGLE draft's decoder layer
            m.model.fuse_projections()
    if not padded:
        return None
    models, max_query = {0: target.model}, {0: drafter.max_nodes + 1}
    if draft is not None:  # a Llama draft or a feature-reading (EAGLE) one, both on pool model 1
        models[1], max_query[1] = draft.model, drafter.max_nodes + 1
    graphs = GraphRunner(models, pool, runner.backend, cfg.max_batch_size, max_query, bt_width, device,
                         aux_layers=drafter.target_features)
    runner.graphs = graphs
    if hasattr(drafter, "enable_device_loop"):
        drafter.enable_device_loop(graphs)
    return graphs.capture()


def device_ngram(drafter, verifier, runner, cfg: SpecConfig, plan, max_len: int) -> None:
    """Give the n-gram drafter its device histories and the verifier their follow-up launch
    (``plan.ngram_device``)."""
    from specdec.drafters.ngram_device import DeviceNgram

    drafter.device_chains = verifier.followup = DeviceNgram(
        runner, cfg.max_batch_size + plan.admit_ahead, max_len, drafter.k, drafter.max_n, drafter.min_n,
        min_rows=plan.ngram_min_rows, budget=lambda: drafter.node_budget)


def make_pipeline(drafter, verifier, runner, plan):
    """The overlap of each step's host work with the next step's device work (``plan.pipeline``): one
    ``StepPipeline`` with the proposer's hook, which the verifier holds."""
    from specdec.pipeline import StepPipeline
    from specdec.pipeline_hooks import ChainAhead, DecodeFollow, EagleAhead

    if verifier.followup is None:  # (target-only decoding, and EAGLE's budget-0 steps)
        verifier.followup = DecodeFollow(runner)
    if plan.proposer == "eagle":  # (at budget 0 its steps are queued as plain decoding's)
        hook = EagleAhead(drafter, ChainAhead(drafter, runner, 0, verifier.followup))
    else:  # n-gram chains looked up on the device, or target-only decoding
        hook = ChainAhead(drafter, runner, drafter.max_nodes, verifier.followup)
    verifier.pipeline = StepPipeline(runner, drafter, verifier, hook)
    return verifier.pipeline


def fuse_verify(drafter, verifier, controller, graph_report) -> None:
    """Verify the EAGLE device program's trees from the device (``fused_step.FusedVerify``, the verifier's), and
    capture a dynamic program's tree-building graphs at start (``FusedVerify.prepare``) for every budget a step
    may use (the controller's, else the drafter's one), counted in the graph report."""
    from specdec.fused_step import FusedVerify

    shape = drafter.program_shape()
    if shape is None:
        return
    nodes, levels, dynamic = shape
    verifier.fused = fused = FusedVerify(verifier, nodes, levels, dynamic)
    drafter.fused_verify = True
    start = time.perf_counter()
    budgets = [o.nodes for o in controller.options] if controller else [drafter.node_budget]
    n = fused.prepare(budgets)
    if n and graph_report is not None:
        graph_report.graphs += n
        graph_report.seconds += time.perf_counter() - start
