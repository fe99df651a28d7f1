"""python -P group.py ROOT MODE STEPS: medians (us/step) of commit_accepted, _route, Snapshot, sync_tables, schedule and host."""
import gc, os, sys, time, statistics, argparse, collections
import __editable___specdec_0_1_0_finder as f
root, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
for k, v in list(f.MAPPING.items()):
    f.MAPPING[k] = v.replace("/work/wt-route", root)
sys.path.insert(0, root + "/bench")
import torch
torch.set_num_threads(1)
import host_profile as hp
import specdec.engine as em
import specdec.fault_isolation as fi
import specdec.scheduler.scheduler as sm
import specdec.runner as rm
from specdec.routing import OutputQueue
from specdec.sampling_params import SamplingParams
clk = time.thread_time
acc = collections.defaultdict(float)
def wrap(obj, attr, name):
    fn = getattr(obj, attr)
    def w(*a, **k):
        t0 = clk()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += clk() - t0
    setattr(obj, attr, w)
args = argparse.Namespace(vocab=4096, hidden=128, layers=1, tokenizer=None, target="rule", alphabet=128, follow=0.6,
                          device="cpu", dtype="float32", num_blocks=8192, new_tokens=1024)
target = hp.tiny_target(torch.device("cpu"), args, torch.float32)
kind, tree = hp.MODES[mode]
draft = hp.eagle_draft(target) if kind == "eagle" else kind
eng = em.SpecEngine(draft, target, em.SpecConfig(tree=tree, max_batch_size=64, cuda_graphs=True, num_blocks=8192,
                                                adaptive=False if kind == "eagle" else None))
q = OutputQueue(finals_only=len(sys.argv) > 4)
for ids in hp.prompts_for(target.tokenizer, 64, 4096):
    eng.router.own(q, eng.add_request(ids, SamplingParams(max_new_tokens=1024, ignore_eos=True)))
while any(not r.prefill_done for r in q.requests) or eng.scheduler.waiting:
    eng.step(); q.pending.clear()
wrap(em, "commit_accepted", "commit")
wrap(em.SpecEngine, "_route", "route")
wrap(fi.Snapshot, "__init__", "snapshot")
wrap(rm.ModelRunner, "sync_tables", "sync_tables")
wrap(sm.Scheduler, "schedule", "schedule")
from specdec.scheduler.cuda_graphs import GraphRunner
wrap(GraphRunner, "_forward", "forward")
from specdec.drafters.eagle_device import DeviceDraftProgram
wrap(DeviceDraftProgram, "_program", "forward")
for _ in range(10):
    eng.step(); q.pending.clear()
per = collections.defaultdict(list)
if os.environ.get('FAKEDEC'):
    class _D:
        def decode(self, ids, skip_special_tokens=True): return 'ab' * len(ids)
    eng.stopper._backend = _D()
if os.environ.get('NOGC'): gc.collect(); gc.freeze()
for _ in range(steps):
    acc.clear()
    t0 = clk()
    eng.step()
    per["host"].append(clk() - t0 - acc["forward"])
    q.pending.clear()
    for k in ("commit", "route", "snapshot", "sync_tables", "schedule"):
        per[k].append(acc[k])
    per["group"].append(acc["commit"] + acc["route"] + acc["snapshot"] + acc["sync_tables"] + acc["schedule"])
    c = hp.calibration(clk)
    per["calib"].append(c)
    per["group/calib"].append(per["group"][-1] / c * 1e-6 * 100)
    per["host/calib"].append(per["host"][-1] / c * 1e-6 * 100)
assert not any(r.finished for r in q.requests)
print(mode, root.split("/")[-1], " ".join(f"{k}={1e6*statistics.median(v):.0f}" for k, v in per.items()))
