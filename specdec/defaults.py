"""The defaults of a run that names none, one definition for ``SpecConfig`` and every ``specdec`` subcommand.

``SpecConfig``'s ``"auto"`` fields (device, dtype, tree) are resolved by :func:`resolve_auto` once, when an engine
is built; the command line resolves the same names with the same functions before any model loads.
"""

from __future__ import annotations

from dataclasses import replace

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT = "smollm2-135m-draft"  # the shipped EAGLE-style draft of DEFAULT_TARGET
NGRAM_TREE = "chain:8"
# the shipped draft's tree on CUDA (pipelined with a fixed budget, the best fixed tree from batch 1 to 64);
# elsewhere CPU_DRAFT_TREE
CUDA_DRAFT_TREE = "dynamic:31"
CPU_DRAFT_TREE = "chain:4"
# of the GPU's total memory, for one engine's weights and KV pool (specdec/memory_budget.py): two engines in a
# process (bench's speculative and target-only ones) fit side by side
GPU_MEMORY_UTILIZATION = 0.4
MAX_NUM_TOKENS = 2048  # prompt tokens prefilled in a step (SpecConfig.max_num_tokens, --max-num-batched-tokens)


def default_draft(target: str = DEFAULT_TARGET, device: str = "cpu") -> str:
    """The shipped draft when it is installed and ``target`` is its target, else n-gram lookup."""
    try:
        from specdec.loading.default_draft import default_draft_available
    except ImportError:
        return "ngram"
    return DEFAULT_DRAFT if target == DEFAULT_TARGET and default_draft_available() else "ngram"


def default_tree(draft, device: str = "cpu") -> str:
    """The tree of a run that names none: n-gram ``NGRAM_TREE``; a draft model ``CUDA_DRAFT_TREE`` on CUDA, else
    ``CPU_DRAFT_TREE`` (also for target-only decoding, ``draft`` None or 'none', where no tree is drafted)."""
    if draft == "ngram":
        return NGRAM_TREE
    if draft is None or draft == "none":
        return CPU_DRAFT_TREE
    return CUDA_DRAFT_TREE if str(device).startswith("cuda") else CPU_DRAFT_TREE


def default_device(target=None) -> str:
    """Where a loaded ``target`` lives; otherwise CUDA when this machine has it, else the CPU."""
    if hasattr(target, "device"):
        return str(target.device)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str, target=None) -> str:
    """A loaded ``target``'s dtype; otherwise bfloat16 on CUDA, float32 on the CPU."""
    if getattr(target, "dtype", None) is not None:  # (a loaded target: torch is imported already)
        import torch

        if isinstance(target.dtype, torch.dtype):
            return str(target.dtype).removeprefix("torch.")
    return "bfloat16" if str(device).startswith("cuda") else "float32"


def resolve_auto(cfg, draft, target):
    """``cfg`` (a SpecConfig) with its ``"auto"`` device, dtype and tree replaced by the defaults above for this
    draft (a name, a loaded model, 'ngram' or None) and target; ``cfg`` itself when nothing is "auto"."""
    changes = {}
    device = cfg.device
    if device == "auto":
        from specdec.config_checks import check_device

        device = changes["device"] = check_device(default_device(target))
    if cfg.dtype == "auto":
        changes["dtype"] = default_dtype(device, target)
    if cfg.tree == "auto":
        changes["tree"] = default_tree(draft, device)
    return replace(cfg, **changes) if changes else cfg
