"""The options of the two draft trainers (``specdec distill --kind layers`` and ``--kind eagle``) and the
run-control options they share, validated at construction. Free of torch, so ``specdec distill --help`` shows every
default without loading it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.config import DTYPE_NAMES

if TYPE_CHECKING:
    from specdec.training.distill_data import DataSpec

DRAFT_VOCAB = 24576  # the most frequent target tokens; ~98% of held-out ShareGPT assistant tokens
LR = 1e-3  # peak learning rate of a fresh draft
WARM_LR = 3e-4  # of a warm start: a trained draft's weights survive the first steps of a new loss and data


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """The run-control options both training configs share (keyword-only: each config's own fields come first);
    ``check_optimizer_fields`` validates them with the rest of the optimiser's."""

    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    stop_after: int | None = None
    seed: int = 0
    resume: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    save_dtype: str = "bfloat16"

    @property
    def autocast(self) -> bool:
        """bf16 autocast for the training forwards: on CUDA unless ``dtype`` is float32."""
        return self.device.startswith("cuda") and self.dtype != "float32"


def check_counts(cfg, require: Callable[[bool, str, str, object], None], names: tuple[str, ...]) -> None:
    """Check that the int fields ``names`` of a training config are >= 1, then default ``warmup_steps``
    (None) to a tenth of ``steps``, at most 100."""
    for name in names:
        value = getattr(cfg, name)
        require(isinstance(value, int) and value >= 1, name, "an int >= 1", value)
    if cfg.warmup_steps is None:
        object.__setattr__(cfg, "warmup_steps", min(100, cfg.steps // 10))


def check_optimizer_fields(cfg, require: Callable[[bool, str, str, object], None]) -> None:
    """Check lr, warmup_steps, min_lr_ratio, weight_decay, grad_clip, stop_after, seed and device of a
    training config; ``require(ok, name, rule, value)`` raises the config's own error."""
    require(cfg.lr > 0, "lr", "a number > 0", cfg.lr)
    require(0 <= cfg.warmup_steps <= cfg.steps, "warmup_steps", f"in [0, steps={cfg.steps}]", cfg.warmup_steps)
    require(0 <= cfg.min_lr_ratio <= 1, "min_lr_ratio", "in [0, 1]", cfg.min_lr_ratio)
    require(cfg.weight_decay >= 0, "weight_decay", "a number >= 0", cfg.weight_decay)
    require(cfg.grad_clip >= 0, "grad_clip", "a number >= 0 (0 = off)", cfg.grad_clip)
    require(cfg.stop_after is None or 1 <= cfg.stop_after <= cfg.steps, "stop_after",
            f"None or in [1, steps={cfg.steps}]", cfg.stop_after)
    require(isinstance(cfg.seed, int) and cfg.seed >= 0, "seed", "an int >= 0", cfg.seed)
    require(cfg.device.split(":")[0] in ("cpu", "cuda"), "device", "cpu, cuda or cuda:N", cfg.device)


def _requirer(config: str) -> Callable[[bool, str, str, object], None]:
    """``require(ok, name, rule, value)``: a ValueError "<config>.<name> must be <rule>, got <value>" unless ok."""

    def require(ok: bool, name: str, rule: str, value) -> None:
        if not ok:
            raise ValueError(f"{config}.{name} must be {rule}, got {value!r}")

    return require


@dataclass(frozen=True)
class DistillConfig(RunOptions):
    """Options of one run (``specdec distill --help`` explains each); validated at construction."""

    out: str
    target: str = "smollm2-135m"
    layers: int = 2
    init_layers: tuple[int, ...] | None = None
    data: str = "sharegpt"
    num_prompts: int = 4000
    val_prompts: int | None = None
    response_tokens: int = 128
    max_prompt_tokens: int = 256
    temperature: float = 0.0
    gen_batch_size: int = 128
    steps: int = 3000
    batch_size: int = 32
    lr: float = 5e-4
    warmup_steps: int | None = None  # None: min(100, steps // 10)
    ckpt_every: int = 500

    def __post_init__(self) -> None:
        _require = _requirer("DistillConfig")
        check_counts(self, _require, ("layers", "num_prompts", "response_tokens", "max_prompt_tokens",
                                      "gen_batch_size", "steps", "batch_size", "ckpt_every"))
        if self.init_layers is not None:
            object.__setattr__(self, "init_layers", tuple(self.init_layers))
        _require(self.init_layers is None or len(self.init_layers) == self.layers, "init_layers",
                 f"None or {self.layers} target layer indices (one per draft layer)", self.init_layers)
        _require(isinstance(self.out, str) and self.out != "", "out", "a folder path", self.out)
        _require(self.data == "sharegpt" or self.data.endswith(".jsonl"), "data",
                 "'sharegpt' or a path to a .jsonl prompt file", self.data)
        _require(self.val_prompts is None or 0 <= self.val_prompts < self.num_prompts, "val_prompts",
                 f"None (auto) or in [0, num_prompts={self.num_prompts})", self.val_prompts)
        _require(self.temperature >= 0, "temperature", "a number >= 0 (0 = greedy)", self.temperature)
        check_optimizer_fields(self, _require)
        _require(self.dtype in DTYPE_NAMES, "dtype", f"one of {sorted(DTYPE_NAMES)}", self.dtype)
        _require(self.save_dtype in DTYPE_NAMES, "save_dtype", f"one of {sorted(DTYPE_NAMES)}", self.save_dtype)

    @property
    def num_val(self) -> int:
        """Prompts held out for the validation KL: ``val_prompts``, or min(64, num_prompts // 10)."""
        return min(64, self.num_prompts // 10) if self.val_prompts is None else self.val_prompts

    @property
    def data_spec(self) -> DataSpec:
        from specdec.training.distill_data import DataSpec

        return DataSpec(self.target, self.data, self.num_prompts, self.response_tokens,
                        self.max_prompt_tokens, float(self.temperature), self.seed, self.dtype)


@dataclass(frozen=True)
class EagleTrainConfig(RunOptions):
    """Options of one eagle-draft run (``specdec distill --help``); validated at construction."""

    out: str
    tokens: str
    target: str = "smollm2-135m"
    target_name: str | None = None  # the target the folder names (default: target, a path resolved)
    init_from: str | None = None  # a trained eagle draft (folder or registered name) to start from
    draft_vocab: int | None = None  # default DRAFT_VOCAB, or init_from's
    aux_layers: tuple[int, ...] | None = None  # default low, middle, high, or init_from's
    unroll: int = 3
    step_decay: float = 0.8
    max_len: int = 1024
    batch_tokens: int = 16384
    steps: int = 2000
    time_budget: float | None = None
    run_seconds: float | None = None
    loss_temperature: float = 0.7
    sampled_weight: float = 0.0
    lr: float | None = None  # default LR, or WARM_LR with init_from
    warmup_steps: int | None = None
    ckpt_every: int = 200
    val_docs: int = 32
    loss_on: str = "assistant"

    def __post_init__(self) -> None:
        _require = _requirer("EagleTrainConfig")
        if self.draft_vocab is None and self.init_from is None:
            object.__setattr__(self, "draft_vocab", DRAFT_VOCAB)
        if self.lr is None:
            object.__setattr__(self, "lr", LR if self.init_from is None else WARM_LR)
        check_counts(self, _require, ("unroll", "max_len", "batch_tokens", "steps", "ckpt_every"))
        _require(self.draft_vocab is None or isinstance(self.draft_vocab, int) and self.draft_vocab >= 1,
                 "draft_vocab", "an int >= 1 (None: init_from's)", self.draft_vocab)
        _require(self.init_from is None or isinstance(self.init_from, str) and self.init_from.strip() != "",
                 "init_from", "None or a draft folder or registered draft name", self.init_from)
        if self.aux_layers is not None:
            object.__setattr__(self, "aux_layers", tuple(self.aux_layers))
        _require(self.batch_tokens >= self.max_len, "batch_tokens", f">= max_len={self.max_len}", self.batch_tokens)
        _require(0 < self.step_decay <= 1, "step_decay", "in (0, 1]", self.step_decay)
        _require(self.time_budget is None or self.time_budget > 0, "time_budget", "None or seconds > 0",
                 self.time_budget)
        _require(self.run_seconds is None or self.run_seconds > 0, "run_seconds", "None or seconds > 0",
                 self.run_seconds)
        _require(self.loss_temperature > 0, "loss_temperature", "a number > 0", self.loss_temperature)
        _require(0 <= self.sampled_weight <= 1, "sampled_weight", "in [0, 1]", self.sampled_weight)
        check_optimizer_fields(self, _require)
        _require(isinstance(self.val_docs, int) and self.val_docs >= 0, "val_docs", "an int >= 0", self.val_docs)
        _require(self.loss_on in ("assistant", "all"), "loss_on", "'assistant' or 'all'", self.loss_on)

    @property
    def mix(self):
        from specdec.training.eagle_unroll import LossMix

        return LossMix(self.loss_temperature, self.sampled_weight)
