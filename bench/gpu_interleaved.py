"""n-gram speculation against target-only with the runs interleaved (issue 9's batch-16 item).

    python -P bench/gpu_interleaved.py OUT_DIR MODEL PROMPTS [BATCH ...]     (default batch 16)

``gpu_fastpath.py adaptive`` builds one engine per configuration and times its runs back to back, so a
machine whose speed drifts over a minute (seen on the H200: the same target-only engine ran 7,851-9,823
tok/s) biases the ratios. Here the engines of one batch size and schedule (``CONFIGS``: target-only, n-gram
chain:8 with a fixed budget, with the adaptive budget, and with a fixed budget but no n-gram table shared
across requests; with ``ENGINES=eagle``: target-only and the shipped EAGLE draft with topk:2x3 fused and
unfused and dynamic:31) are built first, then timed in rounds, one run of each per round in rotating order; a
speed-up is the median over rounds of that round's ratio. Schedules: waves of ``batch`` prompts (the
``specdec bench`` method) and continuous batching (all prompts submitted, ``batch`` rows; not at batch 1).
80 MT-bench prompts x 128 tokens on CUDA (4 x 16 on the CPU), ``REPEATS`` rounds (default 7 on CUDA;
``REPEATS_B1``, default 3, at batch 1; ``TEMPERATURE``: sampled runs). Writes OUT_DIR/interleaved.json.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_fastpath import CUDA, DEV, log, user_generate  # noqa: E402

from specdec import SamplingParams, SpecConfig, SpecEngine  # noqa: E402
from specdec.loading.registry import load_model  # noqa: E402

# name -> SpecConfig fields ("draft": "ngram", "eagle" for the shipped EAGLE draft, or None); ENGINES picks a set
ENGINE_SETS = {
    "ngram": {"target_only": {"draft": None}, "ngram_fixed": {"draft": "ngram", "adaptive": False},
              "ngram_adaptive": {"draft": "ngram", "adaptive": True},
              "ngram_unshared": {"draft": "ngram", "adaptive": False, "ngram_shared": False}},
    # issue 9, session 9: the n-gram chain's length (a verify of k + 1 tokens per row), fixed budget, beside
    # chain:8 under the adaptive budget (what an n-gram engine on CUDA runs by default)
    "ngram_len": {"target_only": {"draft": None},
                  "ngram_chain8": {"draft": "ngram", "adaptive": False},
                  "ngram_chain4": {"draft": "ngram", "tree": "chain:4", "adaptive": False},
                  "ngram_chain3": {"draft": "ngram", "tree": "chain:3", "adaptive": False},
                  "ngram_chain8_adaptive": {"draft": "ngram", "adaptive": True}},
    # session 9: n-gram chains looked up on the device (drafters/ngram_device.py; the default from 8 rows on CUDA)
    # against the host lookup with and without the shared table (unshared: the device's drafts exactly)
    "ngram_device": {"target_only": {"draft": None},
                     "ngram_host": {"draft": "ngram", "adaptive": False, "ngram_device": False},
                     "ngram_host_unshared": {"draft": "ngram", "adaptive": False, "ngram_device": False,
                                             "ngram_shared": False},
                     "ngram_device": {"draft": "ngram", "adaptive": False},
                     "ngram_device_chain4": {"draft": "ngram", "tree": "chain:4", "adaptive": False},
                     "ngram_device_adaptive": {"draft": "ngram"}},
    # the final set of session 9: the host lookup (shared table) against the engine's default (the device from 8
    # rows), with a fixed budget and with the adaptive one (what an n-gram engine on CUDA runs by default)
    "ngram_final": {"target_only": {"draft": None},
                    "ngram_host": {"draft": "ngram", "adaptive": False, "ngram_device": False},
                    "ngram_device": {"draft": "ngram", "adaptive": False},
                    "ngram_device_adaptive": {"draft": "ngram"}},
    # session 9: the auto budget of pipelined greedy steps (dynamic:31's best 15 nodes above 16 rows) against
    # dynamic:31 at its full size (the default before)
    # session 10: pipelined n-gram steps (the device queues each greedy step's successor before the host reads it)
    "ngram_pipeline": {"target_only": {"draft": None},
                       "ngram_host": {"draft": "ngram", "adaptive": False, "ngram_device": False},
                       "ngram_device": {"draft": "ngram", "adaptive": False, "pipeline": False},
                       "ngram_pipelined": {"draft": "ngram", "adaptive": False},
                       "ngram_pipelined_any": {"draft": "ngram", "adaptive": False, "ngram_device": True}},
    # session 10: target-only decoding pipelined too (SpecConfig(pipeline=True) with no draft; opt-in), against the
    # default target-only and the pipelined n-gram default
    "decode_pipeline": {"target_only": {"draft": None},
                        "target_only_pipelined": {"draft": None, "pipeline": True},
                        "ngram_pipelined": {"draft": "ngram", "adaptive": False}},
    # next session: the speculative defaults against pipelined target-only decoding (before making it the default)
    "decode_flip": {"target_only": {"draft": None},
                    "target_only_pipelined": {"draft": None, "pipeline": True},
                    "ngram_pipelined": {"draft": "ngram", "adaptive": False},
                    "eagle_dynamic31": {"draft": "eagle", "tree": "dynamic:31"}},
    # issue 25: the engine's CUDA defaults (target-only pipelined, the shipped draft's dynamic:31, n-gram chain:8)
    # against unpipelined target-only, greedy or sampled (TEMPERATURE)
    "plan": {"target_only": {"draft": None},
             "target_only_unpipelined": {"draft": None, "pipeline": False},
             "eagle": {"draft": "eagle", "tree": "dynamic:31"},
             "ngram": {"draft": "ngram"}},
    # the same with the shipped draft at a fixed budget (sampled steps pipelined too, no controller)
    "plan_fixed": {"target_only": {"draft": None},
                   "eagle": {"draft": "eagle", "tree": "dynamic:31"},
                   "eagle_fixed": {"draft": "eagle", "tree": "dynamic:31", "adaptive": False},
                   "eagle_fixed15": {"draft": "eagle", "tree": "dynamic:15", "adaptive": False},
                   "ngram": {"draft": "ngram"}},
    "large_batch": {"target_only": {"draft": None},
                    "eagle_dynamic31_auto": {"draft": "eagle", "tree": "dynamic:31"},
                    "eagle_dynamic31_full": {"draft": "eagle", "tree": "dynamic:31", "adaptive": False}},
    # sampled decoding (TEMPERATURE) with the CUDA defaults: the shipped draft (its steps with sampled rows take
    # the adaptive budget, unpipelined) and n-gram chains (fixed budget; own text only for sampled rows)
    "sampled": {"target_only": {"draft": None},
                "eagle_dynamic31": {"draft": "eagle", "tree": "dynamic:31"},
                "ngram_chain8": {"draft": "ngram"}},
    "eagle": {"target_only": {"draft": None},
              "eagle_topk2x3": {"draft": "eagle", "tree": "topk:2x3", "adaptive": False},
              "eagle_dynamic31": {"draft": "eagle", "tree": "dynamic:31", "adaptive": False},
              "eagle_dynamic31_adaptive": {"draft": "eagle", "tree": "dynamic:31", "adaptive": True}},
    "eagle_b1": {"target_only": {"draft": None},
                 "eagle_topk2x3": {"draft": "eagle", "tree": "topk:2x3", "adaptive": False},
                 "eagle_dynamic31": {"draft": "eagle", "tree": "dynamic:31", "adaptive": False}},
    "pipeline": {"target_only": {"draft": None},  # pipelined fused steps (specdec/lookahead.py) against unpipelined
                 "eagle_dynamic31": {"draft": "eagle", "tree": "dynamic:31", "adaptive": False, "pipeline": True},
                 "eagle_dynamic31_unpipelined": {"draft": "eagle", "tree": "dynamic:31", "adaptive": False,
                                                 "pipeline": False},
                 "eagle_dynamic63": {"draft": "eagle", "tree": "dynamic:63", "adaptive": False, "pipeline": True},
                 "eagle_topk2x3": {"draft": "eagle", "tree": "topk:2x3", "adaptive": False, "pipeline": True}},
    # the engine's defaults on CUDA (pipelined, fixed budget) at two tree sizes, beside the unpipelined step and the
    # adaptive budget (the default before session 8)
    "defaults": {"target_only": {"draft": None},
                 "eagle_dynamic31": {"draft": "eagle", "tree": "dynamic:31"},
                 "eagle_dynamic15": {"draft": "eagle", "tree": "dynamic:15"},
                 "eagle_dynamic31_unpipelined": {"draft": "eagle", "tree": "dynamic:31", "adaptive": False,
                                                 "pipeline": False},
                 "eagle_dynamic31_adaptive": {"draft": "eagle", "tree": "dynamic:31", "adaptive": True}},
    "defaults_mid": {"target_only": {"draft": None},  # the same two trees between batch 1 and 64
                     "eagle_dynamic31": {"draft": "eagle", "tree": "dynamic:31"},
                     "eagle_dynamic15": {"draft": "eagle", "tree": "dynamic:15"}},
    # batch 64: s7b's four engines (where it faulted once) and smaller pipelined trees
    "pipeline64": {"target_only": {"draft": None},
                   "eagle_dynamic31": {"draft": "eagle", "tree": "dynamic:31", "adaptive": False, "pipeline": True},
                   "eagle_dynamic31_unpipelined": {"draft": "eagle", "tree": "dynamic:31", "adaptive": False,
                                                   "pipeline": False},
                   "eagle_dynamic63": {"draft": "eagle", "tree": "dynamic:63", "adaptive": False, "pipeline": True},
                   "eagle_dynamic15": {"draft": "eagle", "tree": "dynamic:15", "adaptive": False, "pipeline": True},
                   "eagle_dynamic7": {"draft": "eagle", "tree": "dynamic:7", "adaptive": False, "pipeline": True},
                   "eagle_topk2x3": {"draft": "eagle", "tree": "topk:2x3", "adaptive": False, "pipeline": True},
                   "eagle_chain4": {"draft": "eagle", "tree": "chain:4", "adaptive": False, "pipeline": True}},
    "eagle_topk": {"target_only": {"draft": None},
                   "eagle_topk2x3": {"draft": "eagle", "tree": "topk:2x3", "adaptive": False},
                   "eagle_topk2x3_adaptive": {"draft": "eagle", "tree": "topk:2x3", "adaptive": True}},
    "eagle_dynamic": {"target_only": {"draft": None},
                      "eagle_dynamic31": {"draft": "eagle", "tree": "dynamic:31", "adaptive": False},
                      "eagle_dynamic31_adaptive": {"draft": "eagle", "tree": "dynamic:31", "adaptive": True}},
}
ENGINES = os.environ.get("ENGINES", "ngram")
# KV pool per engine: the default (40% of the free memory) shrinks geometrically over the engines of one process,
# and with 8 of them the GPU ran out of memory mid-run (session 8, s8c/s8d); 80 x (prompt + 128 + lookahead)
# tokens of SmolLM2 + draft fit in well under 2 GiB
KV = {"kv_memory_bytes": 3 << 30} if CUDA else {}
ONLY = os.environ.get("ONLY", "").split()  # names of the set to build (target-only always), default all
SCHEDULES = os.environ.get("SCHEDULES", "").split()  # "waves" and/or "continuous", default both
COLD = os.environ.get("COLD", "") == "1"  # no warm-up: the first round is each engine's first requests
PROMPT_SET = os.environ.get("PROMPT_SET", "mtbench")  # a key of the prompt file ("mtbench" or "sharegpt")
NUM_PROMPTS = int(os.environ.get("NUM_PROMPTS", "0")) or None  # the first N prompts of the set (default all)


REPEATS_B1 = int(os.environ.get("REPEATS_B1", "3"))  # batch 1 runs take ~10x longer


def rounds(engines: dict, prompts, params, batch: int, continuous: bool, repeats: int) -> dict[str, list[float]]:
    """tok/s of every engine in each of ``repeats`` rounds; round r starts at engine r mod len(engines)."""
    names, out = list(engines), {name: [] for name in engines}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(user_generate(engines[name], prompts, params, batch, continuous)["tok_per_s"])
    return out


def main() -> None:
    out, model_path, prompt_file = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    batches = [int(b) for b in sys.argv[4:]] or [16]
    out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(Path(prompt_file).read_text())[PROMPT_SET][:NUM_PROMPTS if CUDA else 4]
    # TEMPERATURE (env, default 0: greedy): sampled runs at that temperature with top-p 0.9, unseeded
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
            engines = {}
            for name, fields in ENGINE_SETS[ENGINES].items():
                if ONLY and name not in ONLY and name != "target_only":
                    continue
                fields = {"tree": "chain:8", **fields}
                draft = fields.pop("draft")
                if draft == "eagle":
                    draft = eagle = eagle or load_model("smollm2-135m-draft", dtype=target.dtype, device=DEV,
                                                        target=target)
                engines[name] = SpecEngine(draft, target, SpecConfig(device=DEV, dtype=dt, max_batch_size=b,
                                                                     prefix_cache=False, **KV, **fields))
            for eng in [] if COLD else engines.values():  # warm-up: a whole batch, so every bucket has run once
                eng.generate(prompts[:b], SamplingParams(max_new_tokens=8, ignore_eos=True))
            runs = rounds(engines, prompts, params, b, continuous, repeats if b > 1 else min(repeats, REPEATS_B1))
            key = f"b{b}_{'continuous' if continuous else 'waves'}"
            entry = res[key] = {name: {"tok_per_s_runs": v, "median": statistics.median(v),
                                       "first_over_later": v[0] / statistics.median(v[1:]) if len(v) > 1 else None,
                                       "mean_accepted_length": engines[name].stats.mean_accepted_length,
                                       "plan": engines[name].plan.as_dict(),
                                       "graphs": getattr(engines[name].graph_report, "graphs", 0),
                                       "capture_s": getattr(engines[name].graph_report, "seconds", 0.0)}
                                for name, v in runs.items()}
            log(f"interleaved {key}: first round / later rounds " + ", ".join(
                f"{n} {e['first_over_later']:.2f}" for n, e in entry.items() if e["first_over_later"]))
            for name in [n for n in entry if n != "target_only"]:
                ratios = [s / t for s, t in zip(runs[name], runs["target_only"])]
                entry[name]["ratio_runs"] = ratios
                entry[name]["speedup"] = statistics.median(ratios)
                entry[name]["rounds_at_or_above_1"] = sum(x >= 1.0 for x in ratios)
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
