"""Host time of the n-gram drafter's ``propose`` over recorded greedy replies, in waves of ``batch`` prompts.

    OMP_NUM_THREADS=1 python bench/ngram_host_replay.py REPLIES.json [BATCH] [ROUNDS]

REPLIES is ``{"prompts": [[ids]], "outputs": [[ids]]}`` (``bench/ngram_replay.py --record`` writes one). The
engine's ``NgramDrafter`` proposes for real ``Request`` rows (indexes, the shared table, the draft trees);
greedy verification is replayed from the recorded reply (the longest matching prefix of each chain, then the
bonus token), as the engine would accept it. Timed: ``propose`` (this thread's CPU time), per step and per
row-step, median over ``ROUNDS`` whole runs. ``digest`` hashes every proposed chain: equal digests mean two
versions of the drafter proposed the same drafts.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time

from specdec.scheduler.request import Request

from specdec.drafters.ngram import NgramDrafter
from specdec.sampling_params import SamplingParams

K = 8


def run(prompts: list[list[int]], outputs: list[list[int]], batch: int) -> dict:
    drafter = NgramDrafter(k=K)
    digest, took, row_steps, steps = hashlib.sha256(), 0.0, 0, 0
    for w in range(0, len(prompts), batch):
        outs = outputs[w:w + batch]
        rows = [Request(str(w + i), list(p), SamplingParams(max_new_tokens=len(o))) for i, (p, o)
                in enumerate(zip(prompts[w:w + batch], outs))]
        drafter.prefill([_Chunk(r) for r in rows])
        live = list(zip(rows, outs))
        while live:
            reqs = [r for r, _ in live]
            t0 = time.thread_time()
            trees = drafter.propose(reqs).trees
            took += time.thread_time() - t0
            steps, row_steps = steps + 1, row_steps + len(reqs)
            for (req, out), tree in zip(live, trees):
                chain, done = tree.host.tokens, req.num_output
                digest.update(repr(chain).encode())
                want = out[done:done + len(chain) + 1]
                a = next((j for j, (x, y) in enumerate(zip(chain, want)) if x != y), min(len(chain), len(want) - 1))
                req.tokens += want[:a + 1]
            live = [(r, o) for r, o in live if r.num_output < len(o)]
    return {"propose_us_per_step": 1e6 * took / steps, "propose_us_per_row_step": 1e6 * took / row_steps,
            "steps": steps, "digest": digest.hexdigest()[:16]}


class _Chunk:
    """A whole-prompt prefill chunk of ``req`` (what ``NgramDrafter.prefill`` reads)."""

    def __init__(self, req: Request) -> None:
        self.req, self.start, self.end = req, 0, len(req.tokens)


def main() -> None:
    data = json.load(open(sys.argv[1]))
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    runs = [run(data["prompts"], data["outputs"], batch) for _ in range(rounds)]
    assert len({r["digest"] for r in runs}) == 1, "proposals differ between identical runs"
    print(json.dumps({"batch": batch, "rounds": rounds, **runs[0],
                      "propose_us_per_step": round(statistics.median(r["propose_us_per_step"] for r in runs), 1),
                      "propose_us_per_row_step": round(statistics.median(r["propose_us_per_row_step"] for r in runs),
                                                       2)}))


if __name__ == "__main__":
    main()
