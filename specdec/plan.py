"""The engine's plan: every "auto" option of a ``SpecConfig`` resolved once, at engine construction.

``resolve_plan`` is the one place where ``None`` (auto) options become decisions. The engine, the drafters and
the benchmarks read the frozen ``EnginePlan`` (``SpecEngine.plan``); none of them re-derives a rule from the
device or the drafter's type. ``specdec generate --stats`` prints it and bench JSON records ``as_dict()``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

PROPOSERS = ("none", "ngram", "draft", "eagle")
NGRAM_DEVICE_MIN_ROWS = 8  # unpipelined n-gram steps of fewer rows look chains up on the host (shared table)
ADMIT_GROUP_FRACTION = 8  # pipelined engines admit in groups of an eighth of max_batch_size, and of at least
ADMIT_GROUP_ROWS = 8  # this many rows in batches of twice as many: ``admit_group``


@dataclass(frozen=True)
class EnginePlan:
    """What one engine does at every step. ``proposer``: none (target-only), ngram, draft (a Llama draft model) or eagle
    (a feature-conditioned draft). ``padded``: steps run in fixed (batch, tokens-per-row) buckets, captured as CUDA
    graphs on CUDA and run eagerly over the same buffers elsewhere. ``device_program``: an eagle draft proposes every
    row's tree with one device program per bucket; ``fused_verify``: its steps launch the verify and the acceptance rule
    in the same program. ``ngram_device``: n-gram chains looked up on the device from ``ngram_min_rows`` rows.
    ``adaptive``: the tree budget controller (per step, or per batch bucket with ``budget_epochs``; 0 nodes: plain
    decoding, where speculating does not pay); by default on CUDA only, where a step's cost depends on the batch enough
    to matter and graph timings are steady (on the CPU tree shapes stay fixed, so acceptance statistics are reproducible
    run to run; no budget ever changes greedy output). ``pipeline``: each step queues its successor on the device before
    the host reads it (greedy and sampled rows; not rows with a repetition penalty). ``budget_epochs``: a pipelined
    engine's budget is held per batch bucket and kind of step (greedy, or with sampled rows) for epochs of steps, chosen
    by measured tokens per second (``budget_policy.EpochBudget``), so queued steps stay valid; an unpipelined engine's
    controller chooses at every step. ``warm_up``: every step shape runs once at construction (``specdec.warm_up``), so
    the graphs captured on first use exist before the first request. ``admit_min_free``: waiting requests join running
    ones once this many rows are free (or the queue's head waited 8 steps): each admission is a prefill step, dearer
    than a decode step, so pipelined engines admit in groups (``admit_group``). ``admit_ahead``: that many
    requests beyond ``max_batch_size`` are admitted and prefilled while every row decodes, and take the rows of
    those that end at the next step (a pipelined engine's group: rows do not wait idle while a group gathers; a
    speculating batch's rows end at different steps)."""

    device: str
    dtype: str
    proposer: str
    tree: str
    attention_backend: str
    padded: bool
    device_program: bool
    fused_verify: bool
    ngram_device: bool
    ngram_min_rows: int
    adaptive: bool
    pipeline: bool
    budget_epochs: bool
    warm_up: bool = False
    admit_min_free: int = 1
    admit_ahead: int = 0

    def __post_init__(self) -> None:
        if self.proposer not in PROPOSERS:
            raise ValueError(f"EnginePlan.proposer must be one of {list(PROPOSERS)}, got {self.proposer!r}")

    def as_dict(self) -> dict:
        """The plan as plain values (bench JSON)."""
        return asdict(self)

    def describe(self) -> str:
        """One line for ``--stats``: the decisions that shape a step."""
        tree = "" if self.proposer == "none" else f" {self.tree}"
        flags = [name for name in ("padded", "device_program", "fused_verify", "ngram_device", "adaptive",
                                   "pipeline", "warm_up") if getattr(self, name)]
        extra = ", budget per batch bucket by measured epochs" if self.budget_epochs else ""
        extra += f", admits once {self.admit_min_free} rows are free" if self.admit_min_free > 1 else ""
        extra += f", prefills {self.admit_ahead} ahead" if self.admit_ahead else ""
        return (f"plan: {self.proposer}{tree} on {self.device} {self.dtype}, attention {self.attention_backend}; "
                f"{' '.join(flags) or 'eager'}{extra}")


def admit_group(max_batch_size: int) -> int:
    """A pipelined engine's admission group (``EnginePlan.admit_min_free``, and its ``admit_ahead``): an eighth of the
    batch, and at least ``ADMIT_GROUP_ROWS`` rows from twice that many rows on. Each group costs a prefill step, and
    a speculating batch's rows end at different steps, so a group of a few rows is a prefill step every few steps; each
    group is prefilled ahead, so no row waits for it. Groups of 8 rows measured fastest at batch 16 and at 64
    (bench/RESULTS.md)."""
    least = ADMIT_GROUP_ROWS if max_batch_size >= 2 * ADMIT_GROUP_ROWS else 1
    return max(least, max_batch_size // ADMIT_GROUP_FRACTION)


def resolve_plan(cfg, device: torch.device, proposer: str, backend: str, max_nodes: int) -> EnginePlan:
    """The plan of an engine with options ``cfg`` (a SpecConfig) on ``device`` whose drafter is ``proposer``
    with at most ``max_nodes`` nodes per tree, its attention backend named ``backend`` ("triton" or "torch").
    Raises ValueError for combinations that cannot run."""
    cuda = device.type == "cuda"
    padded = cfg.cuda_graphs if cfg.cuda_graphs is not None else cuda and backend == "triton"
    if padded and cuda and backend != "triton":
        raise ValueError("SpecConfig.cuda_graphs=True on CUDA needs the Triton attention backend "
                         f"(attention_backend='auto' or 'triton'), got {cfg.attention_backend!r}")
    device_program = padded and proposer == "eagle"
    fused = cfg.fused_verify and device_program
    # the controller: on CUDA for every proposer (pipelined engines hold budgets for epochs: ``epochs`` below)
    adaptive = cfg.adaptive if cfg.adaptive is not None else cuda and proposer in ("draft", "eagle", "ngram")
    adaptive = adaptive and max_nodes > 0
    want_pipeline = cfg.pipeline if cfg.pipeline is not None else cuda
    want_ngram_device = cfg.ngram_device if cfg.ngram_device is not None else cuda
    ngram_device = bool(want_ngram_device and proposer == "ngram" and padded)
    if proposer == "eagle":  # queued fused steps: a budget held for epochs (a per-step choice drops them)
        pipeline = want_pipeline and fused and cfg.adaptive is not True
    elif proposer == "ngram":  # (likewise)
        pipeline = want_pipeline and ngram_device and cfg.adaptive is not True
    elif proposer == "none":
        pipeline = want_pipeline and padded
    else:
        pipeline = False
    pipeline = bool(pipeline)
    # under tensor parallelism every rank must choose the budget rank 0 chose: an epoch's choice is broadcast once
    # it ends, a per-step choice (an unpipelined engine's) would be a broadcast every step, so there is none
    adaptive = adaptive and (pipeline or cfg.tensor_parallel_size == 1)
    epochs = pipeline and adaptive
    min_rows = 1 if cfg.ngram_device or pipeline else NGRAM_DEVICE_MIN_ROWS
    warm = cuda and padded  # (on the CPU nothing is captured, so there is nothing to warm up)
    admit = cfg.admit_min_free or (admit_group(cfg.max_batch_size) if pipeline else 1)
    ahead = cfg.admit_ahead if cfg.admit_ahead is not None else admit if pipeline else 0
    return EnginePlan(str(device), str(cfg.dtype).removeprefix("torch."), proposer, cfg.tree, backend, bool(padded),
                      bool(device_program), bool(fused), ngram_device, min_rows, bool(adaptive), pipeline, bool(epochs),
                      bool(warm), admit, ahead)
