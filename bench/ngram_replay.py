"""Replay the n-gram drafter over recorded greedy replies: tokens per target forward, with and without the
table shared across requests, in waves of ``batch`` prompts (rows step in lockstep).

    python bench/ngram_replay.py REPLIES.json [BATCH]     # REPLIES: {"prompts": [[ids]], "outputs": [[ids]]}
    python bench/ngram_replay.py --record REPLIES.json    # record: 80 MT-bench x 128 tokens, target-only, CPU

Greedy verification accepts the longest prefix of a chain that matches the target's own reply, so replaying
the recorded replies gives exactly the engine's accepted lengths (float32 on the CPU; bf16 replies differ
slightly) without running the target. Each wave lasts as long as its slowest row: ``wave_gain`` is the
target-only step count over the speculative one in waves, the bound on a waves speed-up at zero step overhead.
"""

from __future__ import annotations

import json
import sys

from specdec.drafters.ngram import NgramIndex, SharedNgrams

K, MAX_N = 8, 4


def replay(prompts: list[list[int]], outputs: list[list[int]], batch: int, shared: bool) -> dict:
    table = SharedNgrams() if shared else None
    steps = wave_steps = proposed = 0
    for w in range(0, len(prompts), batch):
        rows = [(list(p), o, NgramIndex(MAX_N, 1, table)) for p, o in zip(prompts[w:w + batch], outputs[w:w + batch])]
        for toks, _, index in rows:
            index.update(toks, len(toks))  # prefill
        done = [0] * len(rows)
        while any(d < len(o) for d, (_, o, _) in zip(done, rows)):
            wave_steps += 1
            for i, (toks, out, index) in enumerate(rows):
                p = done[i]
                if p >= len(out):
                    continue
                chain = index.lookup(toks, min(K, len(out) - p - 1))
                a = next((j for j, (x, y) in enumerate(zip(chain, out[p:])) if x != y), min(len(chain), len(out) - p))
                toks += out[p:p + a + 1]
                done[i] = min(p + a + 1, len(out))
                steps += 1
                proposed += len(chain)
    n = sum(map(len, outputs))
    plain = sum(max(map(len, outputs[w:w + batch])) for w in range(0, len(outputs), batch))  # target-only steps
    return {"mean_accepted_length": round(n / steps, 3), "wave_steps": wave_steps,
            "wave_gain": round(plain / wave_steps, 3), "proposed_per_step": round(proposed / steps, 2)}


def record(path: str) -> None:
    import torch

    from specdec import SamplingParams, SpecConfig, SpecEngine
    from specdec.benchmark.data import load_mtbench
    from specdec.loading.registry import load_model
    from specdec.prompts import to_prompt_ids

    target = load_model("smollm2-135m", dtype=torch.float32)
    prompts = [to_prompt_ids(p.to_messages(), target.tokenizer) for p in load_mtbench()]
    eng = SpecEngine(None, target, SpecConfig(max_batch_size=16, prefix_cache=False))
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=128, ignore_eos=True), use_tqdm=True)
    with open(path, "w") as f:
        json.dump({"prompts": prompts, "outputs": [o.token_ids for o in outs]}, f)


def main() -> None:
    if sys.argv[1] == "--record":
        return record(sys.argv[2])
    data = json.load(open(sys.argv[1]))
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    for shared in (False, True):
        print(json.dumps({"batch": batch, "shared": shared, **replay(data["prompts"], data["outputs"], batch, shared)}))


if __name__ == "__main__":
    main()
