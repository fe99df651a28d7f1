"""``SpecConfig``: the engine's options, checked at construction (``config_checks``); ``plan.resolve_plan`` turns
its "auto" fields into the engine's decisions."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.config_checks import check_spec_config
from specdec.defaults import GPU_MEMORY_UTILIZATION, MAX_NUM_TOKENS
from specdec.tree_spec import template_from_spec


@dataclass(frozen=True)
class SpecConfig:
    """Engine options. ``tree``: 'chain:K', 'topk:WxD' or 'dynamic:B' (draft model) or the n-gram
    chain length as 'chain:K'. KV pool size: ``num_blocks`` or ``kv_memory_bytes`` (default 256 MiB
    on CPU; on CUDA what ``gpu_memory_utilization`` leaves, specdec/memory_budget.py). ``"auto"`` (tree,
    device, dtype) takes the command line's defaults when the engine is built (specdec/defaults.py):
    n-gram chain:8, a draft model dynamic:31 on CUDA else chain:4; the loaded target's device, else CUDA when
    present; the loaded target's dtype, else bfloat16 on CUDA and float32 on the CPU."""

    tree: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_bytes: int | None = None
    max_batch_size: int = 64
    max_num_tokens: int = MAX_NUM_TOKENS
    policy: str = "guaranteed_no_evict"
    prefix_cache: bool = True
    attention_backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION  # of the GPU's total memory: weights + KV pool
    ngram_max_n: int = 4
    ngram_shared: bool = True  # the n-gram drafter also looks in other requests' text (drafters/ngram.py)
    ngram_device: bool | None = None  # n-gram chains looked up on the device (drafters/ngram_device.py)
    cuda_graphs: bool | None = None  # padded steps, captured on CUDA; True on the CPU: the same steps, eagerly
    window_reuse: bool = True  # sliding-window models release blocks outside every window
    adaptive: bool | None = None  # the tree budget controller (specdec/budget_policy.py)
    fused_verify: bool = True  # EAGLE device-program steps launch the verify (and the sampled rule) with the draft
    pipeline: bool | None = None  # steps queue their successor on the device before the host reads them
    admit_min_free: int | None = None  # waiting requests join running ones once this many rows are free
    admit_ahead: int | None = None  # requests prefilled beyond max_batch_size, each taking the next row that frees
    tensor_parallel_size: int = 1  # > 1: this process is one rank of the target's tensor-parallel group
    # None = auto for ngram_device, cuda_graphs, adaptive, pipeline, admit_min_free and admit_ahead:
    # ``specdec.plan.resolve_plan`` decides, once (``SpecEngine.plan``; docs/design.md lists the rules)

    def __post_init__(self) -> None:
        check_spec_config(self)  # types and ranges of every field; raises FieldError naming it

    @property
    def tree_spec(self):
        return template_from_spec(self.tree)
