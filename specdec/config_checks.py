"""Type-strict validation of ``SpecConfig`` (kept apart from the engine so the engine stays short)."""

from __future__ import annotations

import numbers
import os

import torch

from specdec.errors import FieldError

ATTENTION_BACKENDS = ("auto", "torch", "triton")
# the largest values the engine can hold: every row of the batch has a block-table row (int32, one entry per
# block of the model's longest sequence) and a row in each persistent step buffer, allocated at start
UPPER_BOUNDS = {"block_size": 1024, "max_batch_size": 4096, "max_num_tokens": 1 << 20, "ngram_max_n": 64,
                "num_blocks": 1 << 24, "tensor_parallel_size": 1024}


def check_spec_config(cfg) -> None:
    """Raise FieldError naming the first field of ``cfg`` with a wrong type or value; normalises
    ``policy`` (a CapacityPolicy becomes its string) and ``device`` (a torch.device becomes a str)."""
    from specdec.loading.base import DTYPE_ALIASES, DTYPES
    from specdec.scheduler.scheduler import CapacityPolicy
    from specdec.tree_spec import template_from_spec

    _require(isinstance(cfg.tree, str), "tree", "must be a str: auto, chain:K, topk:WxD or dynamic:B", cfg.tree)
    try:
        if cfg.tree != "auto":
            template_from_spec(cfg.tree)
    except ValueError as err:
        raise FieldError("SpecConfig", "tree", f"is not a valid tree ({err})", cfg.tree) from None
    for name in ("block_size", "max_batch_size", "max_num_tokens", "ngram_max_n", "tensor_parallel_size"):
        _int_field(cfg, name, optional=False, hi=UPPER_BOUNDS[name])
    _int_field(cfg, "admit_min_free", optional=True, why=" or None (auto)", hi=cfg.max_batch_size)
    _int_field(cfg, "admit_ahead", optional=True, why=" or None (auto)", hi=cfg.max_batch_size,
               unit=" (max_batch_size)", lo=0)
    _int_field(cfg, "num_blocks", optional=True, why=" or None (sized by memory)", hi=UPPER_BOUNDS["num_blocks"])
    if isinstance(cfg.policy, CapacityPolicy):
        object.__setattr__(cfg, "policy", cfg.policy.value)
    policies = [p.value for p in CapacityPolicy]
    _require(cfg.policy in policies, "policy", f"must be one of {policies}", cfg.policy)
    _require(isinstance(cfg.prefix_cache, bool), "prefix_cache", "must be a bool", cfg.prefix_cache)
    _require(cfg.attention_backend in ATTENTION_BACKENDS, "attention_backend",
             f"must be one of {list(ATTENTION_BACKENDS)}", cfg.attention_backend)
    if isinstance(cfg.dtype, str) and cfg.dtype in DTYPE_ALIASES:  # ("half" is "float16", as in vLLM)
        object.__setattr__(cfg, "dtype", DTYPE_ALIASES[cfg.dtype])
    known = cfg.dtype in DTYPES.values() if isinstance(cfg.dtype, torch.dtype) else cfg.dtype in ["auto", *DTYPES]
    _require(known, "dtype", f"must be 'auto' or one of {sorted(DTYPES)} (or {sorted(DTYPE_ALIASES)})", cfg.dtype)
    if cfg.device != "auto":
        object.__setattr__(cfg, "device", check_device(cfg.device))
    auto = "cuda" if torch.cuda.is_available() else "cpu"  # the device "auto" most likely becomes
    memory = device_memory(auto if cfg.device == "auto" else cfg.device)
    _int_field(cfg, "kv_memory_bytes", optional=True, why=" or None", hi=memory, unit=" (the device's memory)")
    util = cfg.gpu_memory_utilization
    _require(isinstance(util, numbers.Real) and not isinstance(util, bool) and 0 < util <= 1,
             "gpu_memory_utilization", "must be a number in (0, 1] (a fraction of the GPU's total memory)", util)
    _require(isinstance(cfg.window_reuse, bool), "window_reuse", "must be True or False", cfg.window_reuse)
    _require(isinstance(cfg.ngram_shared, bool), "ngram_shared", "must be True or False", cfg.ngram_shared)
    _require(cfg.ngram_device is None or isinstance(cfg.ngram_device, bool), "ngram_device",
             "must be None (auto), True or False", cfg.ngram_device)
    _require(isinstance(cfg.fused_verify, bool), "fused_verify", "must be True or False", cfg.fused_verify)
    _require(cfg.pipeline is None or isinstance(cfg.pipeline, bool), "pipeline", "must be None (auto), True or False",
             cfg.pipeline)
    _require(cfg.adaptive is None or isinstance(cfg.adaptive, bool), "adaptive", "must be None (auto), True or False",
             cfg.adaptive)
    _require(cfg.cuda_graphs is None or isinstance(cfg.cuda_graphs, bool), "cuda_graphs",
             "must be None (auto), True or False", cfg.cuda_graphs)


def check_device(device) -> str:
    """The device as a string; FieldError if it is not a torch device or CUDA is not available."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise FieldError("SpecConfig", "device", "must be a torch device such as 'cpu' or 'cuda:0'", device) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        remedy = "install a CUDA build of torch" if torch.version.cuda is None else \
            "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
        raise FieldError("SpecConfig", "device", f"is a CUDA device, but this torch ({torch.__version__}) sees no CUDA "
                         f"device: use 'cpu' or {remedy}", str(device))
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise FieldError("SpecConfig", "device", f"must name one of the {torch.cuda.device_count()} CUDA devices",
                         str(device))
    return str(dev)


def device_memory(device: str) -> int:
    """Bytes of memory of ``device``: the GPU's total memory, or the machine's physical memory for the CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        try:
            return torch.cuda.get_device_properties(dev.index or 0).total_memory
        except (AssertionError, RuntimeError):  # no usable CUDA here: the engine's own device check says so
            return 2**62
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _int_field(cfg, name: str, optional: bool, hi: int, why: str = "", unit: str = "", lo: int = 1) -> None:
    """Field ``name`` an int in [lo, hi] (None too when ``optional``), stored as int; FieldError otherwise."""
    value = getattr(cfg, name)
    if optional and value is None:
        return
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    _require(ok and lo <= value <= hi, name, f"must be an int >= {lo} and <= {hi}{unit}{why}", value)
    object.__setattr__(cfg, name, int(value))


def _require(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise FieldError("SpecConfig", name, rule, value)
