"""``specdec distill --kind eagle``: train a feature-conditioned draft on a token file.

Conversations of the token file (``training.eagle_data``) are grouped into batches of at most
``batch_tokens`` padded tokens, conversations of similar length together (``_epoch_batches``); the target
prefills each batch (teacher distributions over the draft vocabulary and the features), the draft runs
``unroll`` steps (``training.eagle_unroll``) and AdamW minimises the KL (``eagle_unroll.LossMix``: at
temperature 1, optionally mixed with the KL at a sampling temperature). Batch ``s`` and the learning rate of
step ``s`` are pure functions of (seed, s) and the planned step count, so a run resumed from ``OUT/ckpt.pt``
continues exactly. With ``time_budget`` (seconds over all runs) the planned step count is fitted to the budget
from timed steps until a quarter of it is spent (``StepPlanner``) and stored; ``run_seconds`` ends one run early
(checkpointed), so a budget can be spent over several runs. ``init_from`` starts from a trained eagle draft
(``training.eagle_init``) instead of a fresh one, at a lower default peak learning rate; its validation figures
before the first step open the record.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from specdec.training.configs import EagleTrainConfig
from specdec.training.eagle_data import TokenFile
from specdec.training.schedule import report_losses, warmup_cosine

PROBE_STEPS = 20  # steps a run times before a time budget first plans the step count
REPLAN_UNTIL = 0.25  # the step count is planned again at doubling intervals until this fraction of the budget is spent
LOG_EVERY = 10
MUST_MATCH = ("target", "tokens", "init_from", "draft_vocab", "aux_layers", "unroll", "step_decay", "max_len",
              "batch_tokens", "lr", "warmup_steps", "min_lr_ratio", "weight_decay", "grad_clip", "seed", "val_docs",
              "loss_on", "loss_temperature", "sampled_weight")


@dataclass
class EagleState:
    """Progress: steps done, planned steps, per-step loss, validation records, seconds over all runs, and the
    record of the draft the run started from (``eagle_init.init_record``; None for a fresh draft)."""

    step: int = 0
    planned: int = 0
    losses: list[float] = field(default_factory=list)
    val: list[dict] = field(default_factory=list)
    train_seconds: float = 0.0
    tokens_seen: int = 0  # tokens of the documents trained on, padding not counted
    init: dict | None = None


LENGTH_WINDOW = 1024  # an epoch's conversations are sorted by length in windows of this many, then cut into batches
ROW_MULTIPLE = 32  # a batch's rows are padded to a multiple of this many tokens (few distinct shapes on the GPU)


def padded_length(n: int, max_len: int) -> int:
    """The row length a batch whose longest conversation has ``n`` tokens is padded to (at most ``max_len``)."""
    return min(max_len, -(-n // ROW_MULTIPLE) * ROW_MULTIPLE)


@lru_cache(maxsize=4)
def _epoch_batches(seed: int, epoch: int, lengths: tuple[int, ...], batch_tokens: int) -> tuple[tuple[int, ...], ...]:
    """One epoch's batches of document indices (``lengths``: each document's padded row length): a permutation,
    sorted by length within windows of ``LENGTH_WINDOW``, each window cut so that rows * longest row <=
    batch_tokens (a batch never spans two windows: one that did would pad the next window's short rows to the
    last one's longest), then the batches shuffled."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    batches = []
    for w in range(0, len(order), LENGTH_WINDOW):
        cur, longest = [], 0
        for i in sorted(order[w:w + LENGTH_WINDOW], key=lambda j: lengths[j]):
            if cur and max(longest, lengths[i]) * (len(cur) + 1) > batch_tokens:
                batches.append(tuple(cur))
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, lengths[i])
        if cur:
            batches.append(tuple(cur))
    perm = torch.randperm(len(batches), generator=g).tolist()
    return tuple(batches[i] for i in perm)


def batch_docs(step: int, lengths: tuple[int, ...], batch_tokens: int, seed: int) -> tuple[int, ...]:
    """Document indices of batch ``step`` (epochs follow one another)."""
    epoch = 0
    while True:
        batches = _epoch_batches(seed, epoch, lengths, batch_tokens)
        if step < len(batches):
            return batches[step]
        step -= len(batches)
        epoch += 1


def make_rows(data: TokenFile, docs, max_len: int, loss_on: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token rows (B, S) and the positions (B, S) whose next token is scored; S is the longest
    document's ``padded_length``."""
    pieces = [data.doc(i) for i in docs]
    s = padded_length(max(len(ids) for ids, _ in pieces), max_len)
    ids = np.zeros((len(pieces), s), dtype=np.int64)
    valid = np.zeros((len(pieces), s), dtype=bool)
    for b, (tok, mask) in enumerate(pieces):
        n = min(len(tok), s)
        ids[b, :n] = tok[:n]
        nxt = mask[1:n] if loss_on == "assistant" else np.ones(n - 1, dtype=bool)
        valid[b, :n - 1] = nxt
    return torch.from_numpy(ids).to(device), torch.from_numpy(valid).to(device)


def lr_at(step: int, cfg: EagleTrainConfig, planned: int) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` at ``planned``."""
    return warmup_cosine(step, cfg.lr, cfg.warmup_steps, planned, cfg.min_lr_ratio)


def plan_steps(cfg: EagleTrainConfig, step: int, elapsed: float, recent: list[float]) -> int:
    """The planned step count after timed steps: what fits the time budget (at the recent mean step time), at
    least ``step`` and at most ``cfg.steps``."""
    per_step = sum(recent) / len(recent)
    fit = step + int(max(0.0, cfg.time_budget - elapsed) / per_step)
    return max(step, min(cfg.steps, fit))


class StepPlanner:
    """Fits ``state.planned`` to ``cfg.time_budget`` from timed steps: once a run has timed ``PROBE_STEPS`` steps (the
    later half of them), then from the steps since, at doubling intervals, while less than ``REPLAN_UNTIL`` of the
    budget is spent (later the learning-rate schedule's horizon stays put). A run's first steps are the slowest (kernels
    and memory set up for new shapes): planned from them alone, a 600 s budget once got 756 steps that took 318 s.
    Without a time budget it plans nothing."""

    def __init__(self, cfg: EagleTrainConfig, state: EagleState) -> None:
        self.cfg, self.gap, self.times, self.first = cfg, PROBE_STEPS, [], True
        budget = cfg.time_budget
        early = budget is not None and (state.step == 0 or state.train_seconds < REPLAN_UNTIL * budget)
        self.next = state.step + PROBE_STEPS if early else None

    @property
    def timing(self) -> bool:
        """Whether steps are timed now (each then waits for the device, so that its time is its own)."""
        return self.next is not None

    def observe(self, state: EagleState, seconds: float, elapsed: float) -> bool:
        """One more step done in ``seconds`` (``elapsed``: training seconds over all runs); True when it planned."""
        if self.next is None:
            return False
        self.times.append(seconds)
        if state.step < self.next:
            return False
        recent = self.times[len(self.times) // 2:] if self.first else self.times
        state.planned = plan_steps(self.cfg, state.step, elapsed, recent)
        self.gap, self.times, self.first = 2 * self.gap, [], False
        self.next = state.step + self.gap if elapsed < REPLAN_UNTIL * self.cfg.time_budget else None
        return True


def split_docs(data: TokenFile, val_docs: int) -> tuple[int, int]:
    """(number of training documents, number of validation documents); validation is the file's tail."""
    val = min(val_docs, data.num_docs // 5)
    if data.num_docs - val < 1:
        raise ValueError(f"the token file has {data.num_docs} conversations: none left to train on")
    return data.num_docs - val, val


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def config_record(cfg: EagleTrainConfig) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}


def check_resumable(path: Path, old: dict, cfg: EagleTrainConfig) -> None:
    """A checkpoint made with other training-shaping options is an error naming them."""
    now = config_record(cfg)
    diff = {k: (old.get(k), now[k]) for k in MUST_MATCH if old.get(k) != now[k]}
    if diff:
        raise ValueError(f"cannot resume {path}: options differ (checkpoint, asked): {diff}")


VAL_FIELDS = {"kl": 5, "top1": 4, "kl_t": 5, "overlap_t": 4}  # per-step validation figures and their rounding


def evaluate(cfg: EagleTrainConfig, target, draft, data: TokenFile, docs: list[int]) -> dict:
    """Per unrolled step over ``docs``: mean KL and top-1 agreement with the teacher, and at ``loss_temperature``
    the mean KL and the mean overlap sum min(p_T, q_T) (``eagle_unroll.UnrolledLoss``)."""
    from specdec.training.eagle_unroll import teacher_forward, unrolled_loss

    sums, count = {k: np.zeros(cfg.unroll) for k in VAL_FIELDS}, np.zeros(cfg.unroll)
    rows_per_batch = max(1, cfg.batch_tokens // cfg.max_len)
    with torch.no_grad(), torch.autocast(cfg.device.split(":")[0], dtype=torch.bfloat16, enabled=cfg.autocast):
        for i in range(0, len(docs), rows_per_batch):
            ids, valid = make_rows(data, docs[i:i + rows_per_batch], cfg.max_len, cfg.loss_on, cfg.device)
            out = unrolled_loss(draft, teacher_forward(target, draft, ids), ids, valid, cfg.unroll, cfg.step_decay,
                                cfg.mix, measure=True)
            n = np.array([float(c) for c in out.count])
            for k in VAL_FIELDS:
                sums[k] += np.array([float(x) for x in getattr(out, k)]) * n
            count += n
    count = np.maximum(count, 1)
    record = {k: (sums[k] / count).round(r).tolist() for k, r in VAL_FIELDS.items()}
    return {**record, "temperature": cfg.loss_temperature}


def save_checkpoint(path: Path, cfg: EagleTrainConfig, draft, opt, state: EagleState) -> None:
    from specdec.models.eagle import trained_state
    from specdec.training.distill_data import atomic_save

    atomic_save({"config": config_record(cfg), "trained": trained_state(draft), "optimizer": opt.state_dict(),
                 "rng": rng_state(), "state": asdict(state)}, path)


def load_checkpoint(path: Path, cfg: EagleTrainConfig, draft, opt, init: dict | None = None) -> EagleState:
    """The state of checkpoint ``path``, its weights and optimiser moments loaded over ``draft`` and ``opt``; ValueError
    when its options, draft vocabulary or start draft (``init``, its file digest) are not this run's."""
    ckpt = torch.load(path, weights_only=False, map_location="cpu")
    check_resumable(path, ckpt["config"], cfg)
    vocab = ckpt["trained"].get("vocab_ids")
    if vocab is not None and not torch.equal(vocab, draft.vocab_ids.cpu()):
        raise ValueError(f"cannot resume {path}: its draft vocabulary is not this run's (the token file or the "
                         "--init-from draft changed)")
    started = (ckpt["state"].get("init") or {}).get("sha256")
    if init is not None and started != init["sha256"]:
        raise ValueError(f"cannot resume {path}: the --init-from draft {init['name']} is not the one the run started "
                         f"from (model.safetensors sha256 {init['sha256']}, checkpoint {started})")
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name in ckpt["trained"]:
                p.copy_(ckpt["trained"][name])
    opt.load_state_dict(ckpt["optimizer"])
    set_rng_state(ckpt["rng"])
    return EagleState(**ckpt["state"])


def train(cfg: EagleTrainConfig, target, draft, data: TokenFile, init: dict | None = None) -> EagleState:
    """Train ``draft`` until the planned step count (or ``stop_after``, or ``run_seconds`` of this run); checkpoints
    in ``cfg.out``. ``init``: the record of the trained draft ``draft`` starts from (``cfg.init_from``).

    Documents ``[0, num_train)`` are trained on; the tail gives the validation record at the end (and, for a warm
    start, before the first step).
    """
    from tqdm.auto import tqdm

    from specdec.training.eagle_unroll import teacher_forward, unrolled_loss

    ckpt = Path(cfg.out) / "ckpt.pt"
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    state = EagleState(planned=cfg.steps, init=init)
    if cfg.resume and ckpt.is_file():
        state = load_checkpoint(ckpt, cfg, draft, opt, init)
    elif cfg.resume:
        print(f"distill: --resume but {ckpt} does not exist; training from step 0")
    num_train, num_val = split_docs(data, cfg.val_docs)
    if init is not None and state.step == 0 and num_val:
        state.val.append({"step": 0, **evaluate(cfg, target, draft, data, list(range(num_train, num_train + num_val)))})
    tokens = [min(int(n), cfg.max_len) for n in data.lengths()[:num_train]]  # each document's tokens in its row
    lengths = tuple(padded_length(n, cfg.max_len) for n in tokens)
    planner = StepPlanner(cfg, state)
    t0, base, pending = time.perf_counter(), state.train_seconds, []
    with tqdm(total=state.planned, initial=state.step, desc="distill eagle", unit="step") as bar:
        while state.step < min(state.planned, cfg.stop_after or state.planned):
            ts = time.perf_counter()
            for grp in opt.param_groups:
                grp["lr"] = lr_at(state.step, cfg, state.planned)
            docs = batch_docs(state.step, lengths, cfg.batch_tokens, cfg.seed)
            ids, valid = make_rows(data, docs, cfg.max_len, cfg.loss_on, cfg.device)
            with torch.autocast(cfg.device.split(":")[0], dtype=torch.bfloat16, enabled=cfg.autocast):
                out = unrolled_loss(draft, teacher_forward(target, draft, ids), ids, valid, cfg.unroll,
                                    cfg.step_decay, cfg.mix)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            pending.append(out.loss.detach())
            state.step += 1
            state.tokens_seen += sum(tokens[i] for i in docs)  # (padding not counted)
            if cfg.time_budget is not None and base + time.perf_counter() - t0 > 1.1 * cfg.time_budget:
                state.planned = state.step  # the estimate was off: stop at the budget (+10%)
            if planner.timing:
                if cfg.device.startswith("cuda"):
                    torch.cuda.synchronize()
                now = time.perf_counter()
                if planner.observe(state, now - ts, base + now - t0):
                    bar.total = state.planned
            out_of_time = cfg.run_seconds is not None and time.perf_counter() - t0 >= cfg.run_seconds
            if out_of_time and state.step < state.planned:
                print(f"distill: --run-seconds {cfg.run_seconds:g} reached at step {state.step}/{state.planned}; "
                      "--resume continues")
            saving = out_of_time or state.step % cfg.ckpt_every == 0 or \
                state.step >= min(state.planned, cfg.stop_after or 1 << 60)
            if saving or state.step % LOG_EVERY == 0:
                report_losses(state.losses, pending, bar, "loss", LOG_EVERY)
            if saving:
                state.train_seconds = base + time.perf_counter() - t0
                save_checkpoint(ckpt, cfg, draft, opt, state)
            if out_of_time:
                break
    return state
