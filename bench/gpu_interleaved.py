"""Engines timed against target-only decoding in interleaved rounds, on one machine in one process.

    python -P bench/gpu_interleaved.py OUT_DIR MODEL PROMPTS [BATCH ...]     (default batch 16)
    python -P bench/gpu_interleaved.py --prompts PROMPTS                     (CPU: write the prompt file)

A machine's speed drifts over a minute, so engines timed back to back bias their ratios. Here the engines of
one set (``ENGINES``, a key of ``ENGINE_SETS``; default ``plan``) are built first for each batch size and
schedule, then timed in rounds, one run of each per round in rotating order; an engine's speed-up is the
median over rounds of that round's ratio to target-only. Schedules: waves of ``batch`` prompts (the
``specdec bench`` method) and continuous batching (all prompts submitted, ``batch`` rows; not at batch 1).
PROMPTS is a JSON file of token-id lists by prompt set (``--prompts`` writes it: 80 MT-bench first turns and
200 ShareGPT-eval first turns, chat-templated for SmolLM2). 128 new tokens per prompt on CUDA (4 prompts x 16
tokens on the CPU, for trying the script). Writes OUT_DIR/interleaved.json and logs one summary line per
batch and schedule, prefixed ``interleaved``.

Environment: ``ENGINES`` (engine set), ``ONLY`` (names of the set to build; target-only always),
``SCHEDULES`` ("waves" and/or "continuous", default both), ``REPEATS`` (rounds, default 7 on CUDA),
``REPEATS_B1`` (rounds at batch 1, default 3), ``COLD=1`` (no warm-up: the first round is each engine's first
requests), ``PROMPT_SET`` (a key of the prompt file: "mtbench" or "sharegpt"), ``NUM_PROMPTS`` (the first N of
the set, default all), ``TEMPERATURE`` (sampled runs at that temperature with top-p 0.9, unseeded; default 0).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.budget_policy import EpochBudget
from specdec.graphs import CAPTURED
from specdec.loading.registry import load_model

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"

# name -> SpecConfig fields ("draft": "ngram", "eagle" for the shipped EAGLE draft, or None; "tree" defaults to
# chain:8); ENGINES picks a set. Every set has "target_only" (the engine's defaults with no draft), the
# reference of every ratio.
ENGINE_SETS = {
    # the engine's CUDA defaults (target-only pipelined, the shipped draft's dynamic:31, n-gram chain:8)
    # against unpipelined target-only, greedy or sampled (TEMPERATURE)
    "plan": {"target_only": {"draft": None},
             "target_only_unpipelined": {"draft": None, "pipeline": False},
             "eagle": {"draft": "eagle", "tree": "dynamic:31"},
             "ngram": {"draft": "ngram"}},
    # the shipped draft's CUDA default tree against twice its nodes (same levels; the budget controller cuts both)
    "trees": {"target_only": {"draft": None},
              "eagle": {"draft": "eagle", "tree": "dynamic:31"},
              "eagle63": {"draft": "eagle", "tree": "dynamic:63"}},
    # n-gram's budget controller as it is, with no probe once a bucket's first search has chosen ("no_probes":
    # what the probes' rows, ending at different steps, cost a batch held at plain decoding), and held at plain
    # decoding from its first step, no search and no probe ("plain_only": what an n-gram engine's plain steps cost
    # beside target-only's)
    "ngram_probes": {"target_only": {"draft": None},
                     "ngram": {"draft": "ngram"},
                     "ngram_noprobes": {"draft": "ngram", "no_probes": True},
                     "ngram_plain": {"draft": "ngram", "plain_only": True}},
    # the CUDA defaults against each proposer held at one budget (a tree of that many nodes, no controller): what
    # each budget gives a user, the figure the controller's choice is judged by
    "plan_budgets": {"target_only": {"draft": None},
                     "eagle": {"draft": "eagle", "tree": "dynamic:31"},
                     "eagle_b3": {"draft": "eagle", "tree": "dynamic:3", "adaptive": False},
                     "eagle_b7": {"draft": "eagle", "tree": "dynamic:7", "adaptive": False},
                     "eagle_b15": {"draft": "eagle", "tree": "dynamic:15", "adaptive": False},
                     "ngram": {"draft": "ngram"},
                     "ngram_b1": {"draft": "ngram", "tree": "chain:1", "adaptive": False}},
    # every request asking for its tokens' log-probabilities (top 5: "logprobs", a field of the requests, not of the
    # engine) against the same engines without: what logprobs cost each proposer (its rows stay pipelined)
    "logprobs": {"target_only": {"draft": None},
                 "target_only_lp": {"draft": None, "logprobs": 5},
                 "eagle": {"draft": "eagle", "tree": "dynamic:31"},
                 "eagle_lp": {"draft": "eagle", "tree": "dynamic:31", "logprobs": 5},
                 "ngram": {"draft": "ngram"},
                 "ngram_lp": {"draft": "ngram", "logprobs": 5}},
    # n-gram as by default (its sampled buckets of more than 8 rows held at plain decoding: free_sampled_rows)
    # against searching and probing there too, as before session 45
    "ngram_sampled": {"target_only": {"draft": None},
                      "ngram": {"draft": "ngram"},
                      "ngram_search": {"draft": "ngram", "epoch": {"free_sampled_rows": None}}},
    # pipelined steps (one step's host work overlapped with the next step's GPU work) against unpipelined ones
    "pipeline": {"target_only": {"draft": None},
                 "target_only_unpipelined": {"draft": None, "pipeline": False},
                 "eagle_dynamic31": {"draft": "eagle", "tree": "dynamic:31", "pipeline": True},
                 "eagle_dynamic31_unpipelined": {"draft": "eagle", "tree": "dynamic:31", "pipeline": False},
                 "ngram_pipelined": {"draft": "ngram", "pipeline": True},
                 "ngram_unpipelined": {"draft": "ngram", "pipeline": False}},
}
ENGINES = os.environ.get("ENGINES", "plan")
# KV pool per engine: the default (40% of the free memory) shrinks geometrically over the engines of one process
# and runs out with many engines; 200 x (prompt + 128 + lookahead) tokens of SmolLM2 + draft fit in 3 GiB
KV = {"kv_memory_bytes": 3 << 30} if CUDA else {}
ONLY = os.environ.get("ONLY", "").split()  # names of the set to build (target-only always), default all
SCHEDULES = os.environ.get("SCHEDULES", "").split()  # "waves" and/or "continuous", default both
COLD = os.environ.get("COLD", "") == "1"  # no warm-up: the first round is each engine's first requests
PROMPT_SET = os.environ.get("PROMPT_SET", "mtbench")  # a key of the prompt file ("mtbench" or "sharegpt")
NUM_PROMPTS = int(os.environ.get("NUM_PROMPTS", "0")) or None  # the first N prompts of the set (default all)

REPEATS_B1 = int(os.environ.get("REPEATS_B1", "3"))  # batch 1 runs take ~10x longer
FAILURES_SHOWN = [0]


def _held_plain(make, key):
    """An ``EpochBudget`` bucket state (``make``: its ``_new_state``) held at plain decoding with no search and no
    probe (the ``plain_only`` engines)."""
    state = make(key)
    state.searching, state.held, state.best, state.hold = False, 0, 0, 1 << 30
    return state


def _budget_steps(engine) -> dict[int, int]:
    """Steps the engine's budget controller ran at each node budget (all batch sizes), {} without one."""
    chosen = getattr(engine.adaptive, "chosen", None) or {}
    out: dict[int, int] = {}
    for (_, nodes), steps in chosen.items():
        out[nodes] = out.get(nodes, 0) + steps
    return dict(sorted(out.items()))


def _budget_rates(engine) -> dict:
    """The epoch controller's measured tokens per row-second at each budget, per bucket ({} without one)."""
    measured = getattr(engine.adaptive, "measured", None)
    return measured() if measured else {}


def _epoch_log(engine) -> list[dict]:
    """The epoch controller's ended epochs (``EpochBudget.epoch_log``), [] without one."""
    epochs = getattr(engine.adaptive, "epoch_log", None)
    return epochs() if epochs else []


def _promised(rates: dict, batch: int) -> tuple[int, float] | None:
    """The controller's own promise in the run's batch bucket: the budget it held and that budget's measured tokens
    per row-second over plain decoding's (budget 0), both counted on the same steps (``EpochBudget.measured``); None
    without both figures. Set beside the delivered ratio it shows how far per-row rates overstate a continuous
    batch's gain (the drain and the admissions they do not see)."""
    for name, per in rates.items():
        if name.split()[0] == f"b{batch}" and per:
            held = next(iter(per))  # (the held budget comes first)
            if held and per.get(held) and per.get(0):
                return held, per[held] / per[0]
    return None


def _slot_use(split: dict, tokens: int, batch: int, mal: float) -> float:
    """The share of a round's row-slots (its steps x the batch) that committed at the engine's mean accepted
    length: what the drain, admissions and prefill steps leave of it (target-only decoding in waves: ~1)."""
    return tokens / max(1.0, (split["decode_steps"] + split["prefill_steps"]) * batch * max(mal, 1.0))


def _epoch_summary(epochs: list[dict]) -> str:
    """Per bucket and kind: steps in each phase (search, hold, probe), and each budget's epochs as count x median
    rate (tokens per row-second) [median of the epochs' median step ms]: whether plain decoding's figure, the floor
    every budget is judged against, is what a decode step costs."""
    out = []
    for bucket, greedy in sorted({(e["bucket"], e["greedy"]) for e in epochs}):
        mine = [e for e in epochs if e["bucket"] == bucket and e["greedy"] == greedy]
        phases = {p: sum(e["steps"] for e in mine if e["phase"] == p) for p in ("search", "hold", "probe")}
        per = []
        for nodes in sorted({e["nodes"] for e in mine}):
            of = [e for e in mine if e["nodes"] == nodes]
            per.append(f"{nodes}: {len(of)}x {statistics.median(e['rate'] for e in of):.0f} "
                       f"[{1e3 * statistics.median(e['median_step_s'] for e in of):.2f} ms]")
        line = f"b{bucket} {'greedy' if greedy else 'sampled'} steps {phases} | " + ", ".join(per)
        plain = [e["rate"] for e in mine if e["nodes"] == 0 and e["phase"] == "hold"]
        probes = [e for e in mine if e["phase"] == "probe" and e["best_before"] == 0 and e["nodes"]]
        if plain and probes:  # (what the watch's counts said of each probe from plain decoding, and what it measured)
            floor = statistics.median(plain)
            said = [f"{e['nodes']}: {_gain_of(e):.2f}->{e['rate'] / floor:.2f}" for e in probes]
            line += " | probes from plain (counted -> measured over plain's rate) " + ", ".join(said)
        out.append(line)
    return "; ".join(out)


def _gain_of(epoch: dict) -> float:
    """The watch's counted rate over plain decoding's for the budget an epoch held (nan when nothing was counted)."""
    gain = (epoch.get("shadow_gains") or {}).get(epoch["nodes"])
    return float("nan") if gain is None else gain


def log(*a) -> None:
    print(*a, flush=True)


def report_failures(outs) -> None:
    """Log how many requests of one ``generate`` failed, with the first cause's traceback: a benchmark must not
    pass a failed request off as a short one."""
    bad = [o for o in outs if o.finish_reason == "error"]
    if bad:
        log(f"FAILED {len(bad)} of {len(outs)} requests: {bad[0].error!r}")
        if FAILURES_SHOWN[0] < 5:  # the first few causes in full, then counts only
            FAILURES_SHOWN[0] += 1
            log("".join(traceback.format_exception(bad[0].error)))


def user_generate(engine, prompts, params, batch: int, continuous: bool = False) -> dict:
    """tok/s of ``engine.generate`` (what a user runs: detokenisation and streaming included), ``batch``
    prompts at a time (waves: a wave's early finishers leave its tail under-filled), or with ``continuous``
    all prompts in one call, the engine's ``max_batch_size`` (= batch) refilling freed rows at once."""
    per_call = len(prompts) if continuous else batch
    engine.forget_drafts()  # no drafting from the warm-up's or an earlier round's replies to these prompts
    gc.collect()  # a full collection of the engine's objects takes ~0.2 s: never inside a timed run by chance
    if CUDA:
        torch.cuda.synchronize()
    split = StepSplit(engine)
    t0 = time.perf_counter()
    n_tok = 0
    with split:
        for i in range(0, len(prompts), per_call):
            outs = engine.generate(prompts[i:i + per_call], params)
            n_tok += sum(len(o.token_ids) for o in outs)
            report_failures(outs)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": n_tok, "tok_per_s": n_tok / wall, "split": split.result(wall)}


class StepSplit:
    """Where a run's wall time went: engine steps that ran a prefill, steps that did not (decode steps, the steady
    state a budget controller measures), and the rest (admission, detokenisation, streaming); the steps the
    pipeline adopted from its queue and dropped, and the rows that joined a queued step. (``engine.step`` wrapped
    for the run.)"""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.n = {"decode": 0, "prefill": 0}
        self.s = {"decode": 0.0, "prefill": 0.0}

    def __enter__(self):
        eng, step = self.engine, self.engine.step
        p = eng.pipeline
        self.adopted0, self.dropped0, self.joined0 = (p.adopted, p.dropped, p.joined) if p is not None else (0, 0, 0)

        def timed():
            t = time.perf_counter()
            out = step()
            kind = "prefill" if eng.drafter.step_prefilled else "decode"
            self.n[kind] += 1
            self.s[kind] += time.perf_counter() - t
            return out

        eng.step = timed
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.step  # (the class's method again)

    def result(self, wall: float) -> dict:
        p = self.engine.pipeline
        out = {"decode_steps": self.n["decode"], "decode_s": round(self.s["decode"], 4),
               "prefill_steps": self.n["prefill"], "prefill_s": round(self.s["prefill"], 4),
               "outside_s": round(wall - self.s["decode"] - self.s["prefill"], 4)}
        if p is not None:
            out.update(adopted=p.adopted - self.adopted0, dropped=p.dropped - self.dropped0,
                       joined=p.joined - self.joined0)
        return out


class TritonCompiles:
    """The Triton kernels compiled in this process, in order, each named with its specialisation (argument types,
    constexprs, alignment: Triton's post-compile hook's repr; an empty list
    where Triton or the hook is missing). A compile during a timed round is one engine start did not trigger."""

    def __init__(self) -> None:
        self.names: list[str] = []
        try:
            from triton import knobs
        except ImportError:
            return
        previous = knobs.runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            self.names.append(kwargs.get("repr") or getattr(kwargs.get("fn"), "name", "?"))  # with its specialisation
            return previous(*args, **kwargs) if previous else None

        knobs.runtime.jit_post_compile_hook = hook


COMPILES = TritonCompiles()


def counted_generate(engine, prompts, params, batch: int, continuous: bool,
                     ) -> tuple[float, int, float, list[str], dict]:
    """``user_generate``'s tok/s, with the CUDA graphs captured during the run and their seconds, the Triton
    kernels compiled during it (what engine start did not capture or compile costs the first requests) and the
    run's ``StepSplit``."""
    graphs, seconds, compiled = CAPTURED.graphs, CAPTURED.seconds, len(COMPILES.names)
    run = user_generate(engine, prompts, params, batch, continuous)
    return (run["tok_per_s"], CAPTURED.graphs - graphs, CAPTURED.seconds - seconds, COMPILES.names[compiled:],
            run["split"])


def write_prompts(path: str) -> None:
    """The prompt file: the 80 MT-bench first turns and the first 200 ShareGPT-eval first turns of at most
    1,024 tokens, in SmolLM2's chat template (run on the CPU)."""
    from specdec.benchmark.data import load_mtbench, load_sharegpt
    from specdec.prompts import to_prompt_ids

    tok = load_model("smollm2-135m").tokenizer
    ids = {"mtbench": [to_prompt_ids(p.to_messages(), tok) for p in load_mtbench()]}
    sharegpt = (to_prompt_ids(p.to_messages(), tok) for p in load_sharegpt("eval", 400))  # 200 fit in the first 300
    ids["sharegpt"] = list(itertools.islice((x for x in sharegpt if len(x) <= 1024), 200))
    Path(path).write_text(json.dumps(ids))
    log(", ".join(f"{len(v)} {k}" for k, v in ids.items()) + f" prompts -> {path}")


def rounds(engines: dict, prompts, params, batch: int, continuous: bool, repeats: int,
           late: dict | None = None, splits: dict | None = None) -> dict[str, list[float]]:
    """tok/s of every engine in each of ``repeats`` rounds; round r starts at engine r mod len(engines); ``params``:
    the requests' ``SamplingParams``, or a dict of them by engine name.
    ``late[name]``, when given, gets each round's (graphs captured, seconds, Triton kernels compiled) of that
    engine, ``splits[name]`` each round's ``StepSplit`` result."""
    names, out = list(engines), {name: [] for name in engines}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            tok_per_s, graphs, seconds, compiled, split = counted_generate(
                engines[name], prompts, params[name] if isinstance(params, dict) else params, batch, continuous)
            out[name].append(tok_per_s)
            if late is not None:
                late.setdefault(name, []).append((graphs, round(seconds, 4), compiled))
            if splits is not None:
                splits.setdefault(name, []).append(split)
    return out


def main() -> None:
    if sys.argv[1] == "--prompts":
        return write_prompts(sys.argv[2])
    out, model_path, prompt_file = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    batches = [int(b) for b in sys.argv[4:]] or [16]
    out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(Path(prompt_file).read_text())[PROMPT_SET][:NUM_PROMPTS if CUDA else 4]
    temp = float(os.environ.get("TEMPERATURE", "0"))
    params = SamplingParams(max_new_tokens=128 if CUDA else 16, ignore_eos=True, temperature=temp,
                            top_p=0.9 if temp else 1.0)
    repeats = int(os.environ.get("REPEATS", "7" if CUDA else "2"))
    dt = "bfloat16" if CUDA else "float32"
    target = load_model(model_path, dtype=torch.bfloat16 if CUDA else torch.float32, device=DEV)
    res: dict = {"prompts": len(prompts), "prompt_set": PROMPT_SET, "new_tokens": params.max_new_tokens,
                 "rounds": repeats, "engines": ENGINES, "temperature": temp, "cold": COLD}
    eagle = None
    for b in batches:
        for continuous in (False, True) if b > 1 else (False,):  # one row: both schedules are the same
            if SCHEDULES and ("continuous" if continuous else "waves") not in SCHEDULES:
                continue
            engines, per_engine = {}, {}
            for name, fields in ENGINE_SETS[ENGINES].items():
                if ONLY and name not in ONLY and name != "target_only":
                    continue
                fields = {"tree": "chain:8", **fields}
                draft, logprobs = fields.pop("draft"), fields.pop("logprobs", None)
                per_engine[name] = dataclasses.replace(params, logprobs=logprobs)
                no_probes, plain_only = fields.pop("no_probes", False), fields.pop("plain_only", False)
                epoch = fields.pop("epoch", {})
                if draft == "eagle":
                    draft = eagle = eagle or load_model("smollm2-135m-draft", dtype=target.dtype, device=DEV,
                                                        target=target)
                eng = engines[name] = SpecEngine(draft, target, SpecConfig(device=DEV, dtype=dt, max_batch_size=b,
                                                                           prefix_cache=False, **KV, **fields))
                if isinstance(eng.adaptive, EpochBudget):  # (its config is read as each bucket's state is made)
                    epochs = dict(hold_epochs=1 << 30, max_hold_epochs=1 << 30) if no_probes else {}
                    epochs.update(epoch)
                    eng.adaptive.config = dataclasses.replace(eng.adaptive.config, **epochs)
                    if plain_only:
                        eng.adaptive._new_state = functools.partial(_held_plain, eng.adaptive._new_state)
            for eng in [] if COLD else engines.values():  # warm-up: a whole batch, so every bucket has run once
                eng.generate(prompts[:b], SamplingParams(max_new_tokens=8, ignore_eos=True))
            late: dict = {}
            splits: dict = {}
            runs = rounds(engines, prompts, per_engine, b, continuous,
                          repeats if b > 1 else min(repeats, REPEATS_B1), late, splits)
            key = f"b{b}_{'continuous' if continuous else 'waves'}"
            entry = res[key] = {name: {"tok_per_s_runs": v, "median": statistics.median(v),
                                       "first_over_later": v[0] / statistics.median(v[1:]) if len(v) > 1 else None,
                                       "mean_accepted_length": engines[name].stats.mean_accepted_length,
                                       "plan": engines[name].plan.as_dict(),
                                       "graphs": getattr(engines[name].graph_report, "graphs", 0),
                                       "capture_s": getattr(engines[name].graph_report, "seconds", 0.0),
                                       "warm_up_s": getattr(engines[name].graph_report, "warm_up_seconds", 0.0),
                                       "graph_parts": getattr(engines[name].graph_report, "parts", {}),
                                       "late_captures": late[name],
                                       "budget_steps": _budget_steps(engines[name]),
                                       "budget_rates": _budget_rates(engines[name]),
                                       "epochs": _epoch_log(engines[name]),
                                       "split_runs": splits[name]}
                                for name, v in runs.items()}
            log(f"interleaved {key}: first round / later rounds " + ", ".join(
                f"{n} {e['first_over_later']:.2f} (graphs captured per round "
                f"{[g for g, _, _ in e['late_captures']]}, {sum(s for _, s, _ in e['late_captures']):.2f} s; "
                f"Triton compiles per round {[len(c) for _, _, c in e['late_captures']]})"
                for n, e in entry.items() if e["first_over_later"]))
            log(f"interleaved {key}: engine start (capture + warm-up, s) " + ", ".join(
                f"{n} {e['capture_s']:.1f} + {e['warm_up_s']:.1f}" for n, e in entry.items()))
            log(f"interleaved {key}: steps by node budget, all rounds: " + ", ".join(
                f"{n} {e['budget_steps']}" for n, e in entry.items() if e["budget_steps"]))
            for n, e in entry.items():  # the median round's split of the wall time (ms per step)
                sp = e["split_runs"][len(e["split_runs"]) // 2] if e["split_runs"] else None
                if sp:
                    log(f"interleaved {key}: {n} split (a middle round): {sp['decode_steps']} decode steps "
                        f"{1e3 * sp['decode_s'] / max(sp['decode_steps'], 1):.2f} ms each, {sp['prefill_steps']} "
                        f"prefill steps {1e3 * sp['prefill_s'] / max(sp['prefill_steps'], 1):.2f} ms each, "
                        f"{sp['outside_s']:.3f} s outside steps, adopted {sp.get('adopted')} dropped "
                        f"{sp.get('dropped')} joined {sp.get('joined')}; row-slots committing "
                        f"{_slot_use(sp, len(prompts) * params.max_new_tokens, b, e['mean_accepted_length']):.0%}")
            for n, e in entry.items():
                if e["budget_rates"]:
                    log(f"interleaved {key}: {n} tokens per row-second by budget (held first) {e['budget_rates']}")
            for n, e in entry.items():
                if e["epochs"]:
                    log(f"interleaved {key}: {n} epochs {_epoch_summary(e['epochs'])}")
            for n, e in entry.items():  # which kernels compiled during timed rounds (first round: engine start missed)
                if any(c for _, _, c in e["late_captures"]):
                    log(f"interleaved {key}: {n} compiled {[sorted(set(c)) for _, _, c in e['late_captures']]}")
            for name in [n for n in entry if n != "target_only"]:
                ratios = [s / t for s, t in zip(runs[name], runs["target_only"])]
                entry[name]["ratio_runs"] = ratios
                entry[name]["speedup"] = statistics.median(ratios)
                entry[name]["rounds_at_or_above_1"] = sum(x >= 1.0 for x in ratios)
            for n, e in entry.items():
                got = _promised(e.get("budget_rates") or {}, b)
                if got and "speedup" in e:
                    log(f"interleaved {key}: {n} held budget {got[0]} at {got[1]:.3f}x plain decoding's per-row rate; "
                        f"delivered {e['speedup']:.3f}x target-only's")
            log(f"interleaved {key}: target-only {entry['target_only']['median']:.0f} tok/s; " + ", ".join(
                f"{n} {e['speedup']:.3f}x ({e['rounds_at_or_above_1']}/{len(e['ratio_runs'])} rounds >= 1, "
                f"MAL {e['mean_accepted_length']:.2f})"
                for n, e in entry.items() if n != "target_only"))
            if "target_only_pipelined" in runs:  # each speculative engine against pipelined decoding, per round
                for name in [n for n in entry if not n.startswith("target_only")]:
                    ratios = [s / t for s, t in zip(runs[name], runs["target_only_pipelined"])]
                    entry[name]["speedup_vs_pipelined"] = statistics.median(ratios)
                    log(f"interleaved {key}: {name} against pipelined target-only {statistics.median(ratios):.3f}x "
                        f"(rounds {min(ratios):.3f}-{max(ratios):.3f})")
            (out / "interleaved.json").write_text(json.dumps(res, indent=1))
            del engines
            gc.collect()
            if CUDA:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
