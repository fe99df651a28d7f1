"""python -P runbench.py ROOT [host_profile args]: run ROOT/bench/host_profile.py with specdec imported from ROOT."""
import runpy, sys
import __editable___specdec_0_1_0_finder as f
root = sys.argv[1]
for k, v in list(f.MAPPING.items()):
    f.MAPPING[k] = v.replace("/work/wt-route", root)
sys.argv = [root + "/bench/host_profile.py"] + sys.argv[2:]
sys.path.insert(0, root + "/bench")
runpy.run_path(sys.argv[0], run_name="__main__")
import specdec; print("specdec from", specdec.__file__, file=sys.stderr)
