"""Measured acceptance of trained drafts: mean accepted length on prompt sets, greedy and sampled.

``measure`` runs the engine (target + draft, one fixed tree, no adaptive budget, so the figures say how
good the draft is rather than what the controller chose) over each prompt set at each temperature and
returns, per (set, temperature), the mean accepted length (tokens committed per target forward) and the
acceptance by depth. ``record_measurement`` writes those figures into a draft folder's record
(``specdec_draft.json``, ``training.measured``); ``better_everywhere`` compares two drafts' figures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdec.loading.draft_format import DRAFT_META


@dataclass(frozen=True)
class MeasureConfig:
    """How drafts are measured: ``tree`` for every draft, ``max_new_tokens`` per prompt, ``batch_size`` rows at once,
    each temperature of ``temperatures`` (0: greedy; sampled ones with ``top_p`` and seed ``seed + i`` for prompt i)."""

    tree: str = "dynamic:31"
    temperatures: tuple[float, ...] = (0.0, 0.7)
    top_p: float = 0.9
    max_new_tokens: int = 128
    batch_size: int = 16
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperatures", tuple(self.temperatures))
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"MeasureConfig.temperatures must be one or more numbers >= 0, got {self.temperatures}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"MeasureConfig.top_p must be in (0, 1], got {self.top_p!r}")
        for name in ("max_new_tokens", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"MeasureConfig.{name} must be an int >= 1, got {getattr(self, name)!r}")


def load_prompt_sets(paths: list[str], tokenizer, limit: int | None = None) -> dict[str, list[list[int]]]:
    """Prompt token ids by set name from ``paths``: a ``.json`` of token-id lists by set (``bench/gpu_interleaved.py
    --prompts`` writes one), a ``.jsonl`` prompt file (one set named by the file's stem) or ``mtbench`` /
    ``sharegpt`` (its evaluation split), chat-rendered with ``tokenizer``; at most ``limit`` prompts per set."""
    from specdec.benchmark.data import load_dataset, load_prompt_file
    from specdec.prompts import to_prompt_ids

    sets: dict[str, list[list[int]]] = {}
    for path in map(Path, paths):
        if path.suffix == ".json":
            for name, ids in json.loads(path.read_text()).items():
                sets[name] = [list(map(int, x)) for x in ids]
        elif path.suffix == ".jsonl" or str(path) in ("mtbench", "sharegpt"):
            prompts = load_prompt_file(path) if path.suffix else load_dataset(str(path), limit)
            sets[path.stem] = [to_prompt_ids(p.to_messages(), tokenizer) for p in prompts]
        else:
            raise ValueError(f"prompt set {path} must be a .json of token ids by set, a .jsonl prompt file, "
                             "mtbench or sharegpt")
    if not sets or not all(sets.values()):
        raise ValueError(f"no prompts in {paths}")
    return {k: v[:limit] for k, v in sets.items()}


def measure(draft, target, prompt_sets: dict[str, list[list[int]]], cfg: MeasureConfig) -> list[dict]:
    """One record per (prompt set, temperature): mean accepted length, acceptance by depth, prompts, tokens, seconds."""
    import time

    from specdec.engine import SpecConfig, SpecEngine
    from specdec.outputs import AcceptanceStats
    from specdec.sampling_params import SamplingParams

    engine = SpecEngine(draft, target, SpecConfig(tree=cfg.tree, device=cfg.device, dtype=cfg.dtype, adaptive=False,
                                                  max_batch_size=cfg.batch_size, prefix_cache=False))
    out = []
    for name, prompts in prompt_sets.items():
        for t in cfg.temperatures:
            params = [SamplingParams(temperature=t, top_p=cfg.top_p if t else 1.0, seed=cfg.seed + i,
                                     max_new_tokens=cfg.max_new_tokens) for i in range(len(prompts))]
            t0, total = time.perf_counter(), AcceptanceStats()
            for o in engine.generate(prompts, params):
                if o.error is not None:
                    raise o.error
                total.merge(o.stats)
            out.append({"set": name, "temperature": t, "top_p": cfg.top_p if t else 1.0, "tree": cfg.tree,
                        "mean_accepted_length": round(total.mean_accepted_length, 4),
                        "acceptance_by_depth": [round(x, 4) for x in total.acceptance_by_depth],
                        "prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens,
                        "seconds": round(time.perf_counter() - t0, 2)})
    return out


def better_everywhere(new: list[dict], old: list[dict]) -> bool:
    """True when ``new`` has the higher mean accepted length for every (set, temperature, tree) both measured."""
    key = lambda r: (r["set"], r["temperature"], r["tree"])
    before = {key(r): r["mean_accepted_length"] for r in old}
    pairs = [(r["mean_accepted_length"], before[key(r)]) for r in new if key(r) in before]
    return bool(pairs) and all(a > b for a, b in pairs)


def record_measurement(folder: str | Path, measured: list[dict], device: str, note: str = "") -> None:
    """Add ``measured`` (``measure``'s records, on ``device``) to the training record of draft folder ``folder``."""
    path = Path(folder) / DRAFT_META
    meta = json.loads(path.read_text())
    entry = {"device": device, "results": measured, **({"note": note} if note else {})}
    meta.setdefault("training", {}).setdefault("measured", []).append(entry)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(path)
