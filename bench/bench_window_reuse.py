"""How many long requests one KV pool serves at once, with sliding-window block release on and off.

A random tiny Mistral-style model (every layer windowed) is made with transformers; N requests each
generate ``--new-tokens`` tokens (16x the window by default) under GUARANTEED_NO_EVICT from a pool
of ``--num-blocks`` blocks. Reported per setting: the most requests running at once, engine steps,
the most blocks one request held at a step, the most blocks in use, and wall time.

    python bench/bench_window_reuse.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from specdec.kvcache.sliding_window import live_blocks

from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.registry import load_model, truncate_layers
from specdec.sampling_params import SamplingParams


def tiny_mistral(folder: Path, window: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, sliding_window=window,
                                     max_position_embeddings=4096, initializer_range=0.5)
    transformers.MistralForCausalLM(cfg).save_pretrained(str(folder))
    return load_model(folder)


def run(target, args, reuse: bool) -> dict:
    draft = None if args.tree == "none" else truncate_layers(target, 1)
    eng = SpecEngine(draft, target, SpecConfig(
        tree="chain:1" if draft is None else args.tree, num_blocks=args.num_blocks, block_size=args.block_size,
        prefix_cache=False, window_reuse=reuse, max_batch_size=args.requests))
    g = torch.Generator().manual_seed(1)
    for _ in range(args.requests):
        eng.add_request(torch.randint(3, 256, (args.prompt,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True))
    seen = dict(most_running=0, steps=0, most_blocks_per_request=0, most_blocks_in_use=0)
    schedule = eng.scheduler.schedule

    def recorded():  # after schedule: the step's peak (release, admission and growth are done)
        batch = schedule()
        running, alloc = eng.scheduler.running, eng.allocator
        seen["steps"] += 1
        seen["most_running"] = max(seen["most_running"], len(running))
        seen["most_blocks_per_request"] = max([seen["most_blocks_per_request"]]
                                              + [len(live_blocks(r.blocks)) for r in running])
        seen["most_blocks_in_use"] = max(seen["most_blocks_in_use"], alloc.num_blocks - alloc.num_free)
        return batch

    eng.scheduler.schedule = recorded
    t0 = time.perf_counter()
    while eng.scheduler.has_work:
        eng.step()
    assert eng.all_blocks_free()
    return dict(window_reuse=reuse, **seen, seconds=round(time.perf_counter() - t0, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=140)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=None, help="default: 16x the window")
    ap.add_argument("--tree", default="chain:4", help="draft tree of a 1-layer draft, or 'none' (target only)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.new_tokens = args.new_tokens or 16 * args.window
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        target = tiny_mistral(Path(tmp), args.window)
        rows = [run(target, args, reuse) for reuse in (False, True)]
    for r in rows:
        print(json.dumps(r))
    ratio = rows[1]["most_running"] / rows[0]["most_running"]
    print(f"window {args.window}, block {args.block_size}, pool {args.num_blocks} blocks, {args.requests} requests "
          f"x {args.prompt}+{args.new_tokens} tokens, tree {args.tree}: {ratio:.1f}x the concurrent requests")
    if args.json:
        report = {"config": vars(args), "runs": rows, "concurrency_ratio": ratio}
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
