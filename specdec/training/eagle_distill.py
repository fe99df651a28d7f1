"""One eagle-draft distillation run: token file -> draft vocabulary (or a warm start's) -> training -> draft folder."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.loading.registry import DTYPES
from specdec.training.configs import EagleTrainConfig
from specdec.training.eagle_data import TokenFile, coverage, load_token_files, top_vocab
from specdec.training.eagle_train import EagleState, config_record, evaluate, split_docs, train

COVERAGE_SIZES = (4096, 8192, 16384, 24576, 32768)
RUN_ONLY = ("out", "resume", "tokens", "run_seconds", "stop_after")  # options that do not shape the draft


@dataclass(frozen=True)
class EagleResult:
    """What a run produced: the draft folder (None when stopped early), its record, the state."""

    folder: Path | None
    record: dict
    state: EagleState


def draft_vocabulary(data: TokenFile, num_train: int, vocab_size: int, n: int,
                     kept: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """The ``n`` most frequent assistant tokens of the training conversations (or ``kept``, a warm start's
    vocabulary), and the coverage (share of assistant tokens inside the top-k set) on the held-out conversations
    for several k (and of ``kept``)."""
    split = int(data.offsets[num_train])
    train_tok = data.tokens[:split][data.assistant[:split]]
    held = data.tokens[split:][data.assistant[split:]]
    vocab = top_vocab(train_tok, vocab_size, n) if kept is None else kept
    sizes = sorted({*(k for k in COVERAGE_SIZES if k < vocab_size), n})
    cov = {str(k): round(coverage(held, top_vocab(train_tok, vocab_size, k)), 5) for k in sizes}
    record = {"held_out_assistant_tokens": int(len(held)), "coverage": cov}
    if kept is not None:
        record["coverage_of_kept_vocab"] = round(coverage(held, kept), 5)
    return vocab, record


def distill_eagle(cfg: EagleTrainConfig, target=None) -> EagleResult:
    """Train (or resume) the eagle draft of ``cfg`` and, once the planned steps are done, export it.

    ``target``: the already loaded ``cfg.target`` (in ``cfg.dtype`` on ``cfg.device``), else loaded here."""
    from specdec.loading.registry import load_model
    from specdec.models.eagle import EagleShape, default_aux_layers, eagle_from_target
    from specdec.training.eagle_init import init_record, load_init, settle_config

    t0 = time.perf_counter()
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    data = load_token_files(cfg.tokens)
    if data.meta.get("prompts_only"):
        raise ValueError(f"{cfg.tokens} holds prompts only (each reply cut to its closing tokens): regenerate its "
                         "replies first (specdec distill --kind eagle --regenerate)")
    target = target or load_model(cfg.target, dtype=DTYPES[cfg.dtype], device=cfg.device)
    tcfg = target.config
    ref = cfg.target_name or (str(Path(cfg.target).resolve()) if Path(cfg.target).exists() else cfg.target)
    init = load_init(cfg.init_from, target, ref) if cfg.init_from else None
    cfg = settle_config(cfg, init) if init else cfg
    num_train, num_val = split_docs(data, cfg.val_docs)
    vocab, cov = draft_vocabulary(data, num_train, tcfg.vocab_size, min(cfg.draft_vocab, tcfg.vocab_size),
                                  init.vocab_ids.numpy() if init else None)
    shape = EagleShape(cfg.aux_layers or default_aux_layers(tcfg.num_layers), len(vocab))
    draft = eagle_from_target(target.model, shape, torch.from_numpy(vocab), init.state if init else None,
                              torch.float32, cfg.seed, trainable=True)
    state = train(cfg, target.model, draft, data, init_record(init) if init else None)
    done = state.step >= state.planned
    val_docs = list(range(num_train, num_train + num_val))
    if done and val_docs:
        state.val.append({"step": state.step, **evaluate(cfg, target.model, draft, data, val_docs)})
    record = _record(cfg, data, state, cov, num_train, num_val, time.perf_counter() - t0)
    folder = None
    if done:
        from specdec.loading.eagle_folder import save_eagle_folder

        save_eagle_folder(cfg.out, draft, target, ref, {"training": record}, DTYPES[cfg.save_dtype])
        folder = Path(cfg.out)
    return EagleResult(folder, record, state)


def _record(cfg: EagleTrainConfig, data: TokenFile, state: EagleState, cov: dict, num_train: int, num_val: int,
            wall: float) -> dict:
    from specdec.training.distill import loss_curve

    device = f"{cfg.device} ({torch.cuda.get_device_name(cfg.device)})" if cfg.device.startswith("cuda") \
        else cfg.device
    return {
        "kind": "eagle", **({"init_from": state.init} if state.init else {}), "data": data_record(data.meta),
        "train_conversations": num_train,
        "val_conversations": num_val, "draft_vocab": cov,
        "options": {k: v for k, v in config_record(cfg).items() if k not in RUN_ONLY},
        "tokens_file": ",".join(Path(p.strip()).name for p in cfg.tokens.split(",")),
        "steps": state.step, "planned_steps": state.planned, "tokens_seen": state.tokens_seen,
        "loss": loss_text(cfg),
        "loss_curve": loss_curve(state.losses), "val": state.val, "device": device,
        "precision": "bf16 autocast, fp32 master weights" if cfg.autocast else "float32",
        "train_seconds": round(state.train_seconds, 2), "wall_seconds_this_run": round(wall, 2),
    }


def loss_text(cfg: EagleTrainConfig) -> str:
    """The training loss in words, for the record."""
    kl = "KL(target || draft) over the draft vocabulary"
    if cfg.sampled_weight:
        t = cfg.loss_temperature
        kl = f"{1 - cfg.sampled_weight:g} x {kl} + {cfg.sampled_weight:g} x the same KL at temperature {t:g}"
    return f"sum over {cfg.unroll} unrolled steps (weights {cfg.step_decay}^k) of {kl}, {cfg.loss_on} tokens"


def data_record(meta: dict) -> dict:
    """A token file's metadata for the record: per-conversation lists (``source_docs``, ``turns``) become counts;
    several files' (``load_token_files``) give one record each."""
    if "files" in meta:
        return {**{k: v for k, v in meta.items() if k != "files"}, "files": [data_record(m) for m in meta["files"]]}
    out = {k: v for k, v in meta.items() if not isinstance(v, list)}
    if "turns" in meta:
        out["replies"] = int(sum(meta["turns"]))
    return out


def summary_line(res: EagleResult) -> str:
    s = res.state
    line = f"distill eagle: step {s.step}/{s.planned}, train {s.train_seconds:.1f}s, {s.tokens_seen} tokens"
    if s.losses:
        k = max(1, min(20, len(s.losses) // 5))
        line += f" | loss {np.mean(s.losses[:k]):.4f} -> {np.mean(s.losses[-k:]):.4f}"
    if s.init:
        line += f" | from {s.init['name']}"
    if s.val:
        first = f"{s.val[0]['top1']} at step 0 -> " if s.val[0]["step"] == 0 and len(s.val) > 1 else ""
        line += f" | val top-1 per step {first}{s.val[-1]['top1']}"
    if res.folder is None:
        return line + " | stopped before the last step: continue with --resume"
    size = sum(f.stat().st_size for f in res.folder.iterdir() if f.name in ("model.safetensors",
                                                                               "specdec_draft.json"))
    return line + f" | draft folder {res.folder} ({size / 2**20:.2f} MB)"
