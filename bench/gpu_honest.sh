#!/usr/bin/env bash
# Honest numbers on the GPU machine (issue 11): correctness in bf16 and float32, the batch sweep
# against both transformers configurations, the step and kernel benchmark suites.
#
#   bash bench/gpu_honest.sh prep          # here, on the CPU machine, from the repository root
#
# then, on the GPU machine, consecutive runs (the machine keeps /tmp between runs while it is up):
#   run 1, carry .stage/piece_00:         mkdir -p /tmp/stage && cp .stage/piece_00/* /tmp/stage/
#   run 2, carry .stage/piece_01 .whl:    cp .stage/piece_01/* /tmp/stage/ && bash bench/gpu_honest.sh correctness
#   run 3, carry .whl:                    bash bench/gpu_honest.sh sweep1
#   run 4, carry .whl:                    bash bench/gpu_honest.sh sweepN
#   run 5, carry .whl:                    bash bench/gpu_honest.sh suites
# and back here, from the files of runs 3 and 4 (and run 5's new baseline):
#   python -m specdec.benchmark.plot sweep.png sweep_b1.json sweep_bN.json --json sweep.json
#   cp -r FILES/baselines/Linux-CPython-3.12-64bit bench/baselines/   # the H200 baseline later runs compare against
#
# Each stage writes its logs and JSON under $OUT and prints a short summary last. Stage times, estimated
# from the H200 rates in ../shared/GPU.md (eager engine of 170566d; not yet measured): correctness ~4 min,
# sweep1 ~8 min (batch 1: transformers dynamic-cache generate alone ~150 s), sweepN ~4 min, suites ~3 min.
# Sweep: the first 64 MT-bench prompts, 64 new tokens, n-gram chain:8, transformers dynamic and static+compile.
set -uo pipefail
stage=${1:?usage: gpu_honest.sh prep|correctness|sweep1|sweepN|suites}
# Dry run on the CPU (tiny and quick): OUT=/tmp/o MODEL=<a .gguf> SITE=/tmp/s EXTRA="--num-prompts 2
#   --max-new-tokens 8 --device cpu" TIE_PROMPTS=1 bash bench/gpu_honest.sh correctness
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/model.gguf}
SITE=${SITE:-/tmp/site}
read -r -a EXTRA <<< "${EXTRA:-}"
PROMPTS=.whl/mtbench.jsonl
BENCH=(python3 -P -m specdec.cli bench --target "$MODEL" --draft ngram --dataset "$PROMPTS")
SWEEP=(--num-prompts 64 --max-new-tokens 64 --dtype bfloat16 --baseline hf --hf-configs hf,hf_static)

setup() {
  if [ ! -f "$MODEL" ]; then
    cat /tmp/stage/piece.* > "$MODEL" || { echo "no model pieces in /tmp/stage (runs 1 and 2)" >&2; exit 2; }
  fi
  if [ -f .stage/md5 ] && [ "$(md5sum "$MODEL" | cut -d' ' -f1)" != "$(cat .stage/md5)" ]; then
    echo "model md5 differs from .stage/md5" >&2; exit 2
  fi
  python3 -m pip install -q --no-index --no-deps --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH=$SITE
  [ -f .whl/commit.txt ] && SPECDEC_GIT_COMMIT=$(cat .whl/commit.txt) && export SPECDEC_GIT_COMMIT
  nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv > "$OUT/nvidia-smi.txt" 2>&1
}

summary() {  # the table lines of a bench log (progress bars dropped)
  tr '\r' '\n' < "$1" | grep -v -e 'it/s' -e 's/it' -e 'batch/s' -e 's/batch' -e 'prompt/s' | tail -n "${2:-30}"
}

case "$stage" in
  prep)
    /work/shared/tools/stage-model || exit 1
    python3 -m pip wheel -q --no-deps -w .whl . || exit 1
    rm -rf build
    git describe --always --dirty > .whl/commit.txt
    python3 - <<'EOF'
import json
from specdec.benchmark.data import load_mtbench
with open(".whl/mtbench.jsonl", "w", encoding="utf-8") as fp:
    for p in load_mtbench():
        fp.write(json.dumps({"id": p.id, "category": p.category, "messages": p.messages}) + "\n")
print("wrote .whl/mtbench.jsonl (80 MT-bench first turns)")
EOF
    ;;
  correctness)
    setup
    "${BENCH[@]}" --max-new-tokens 128 --batch-size 16 --dtype bfloat16 --json "$OUT/bf16.json" "${EXTRA[@]}" > "$OUT/bf16.log" 2>&1
    echo "bf16 exit $?" | tee "$OUT/bf16.rc"
    "${BENCH[@]}" --max-new-tokens 128 --batch-size 16 --dtype float32 --json "$OUT/fp32.json" "${EXTRA[@]}" > "$OUT/fp32.log" 2>&1
    echo "float32 exit $?" | tee "$OUT/fp32.rc"
    python3 -P bench/tie_bound_check.py --target "$MODEL" --dataset "$PROMPTS" --num-prompts "${TIE_PROMPTS:-8}" \
      --out "$OUT/tie_check.json" > "$OUT/tie_check.log" 2>&1
    summary "$OUT/bf16.log" 12; summary "$OUT/fp32.log" 6; tail -1 "$OUT/tie_check.log"
    ;;
  sweep1)
    setup
    "${BENCH[@]}" "${SWEEP[@]}" --batch-size 1 --json "$OUT/sweep_b1.json" "${EXTRA[@]}" > "$OUT/sweep_b1.log" 2>&1
    echo "sweep1 exit $?"; summary "$OUT/sweep_b1.log" 14
    ;;
  sweepN)
    setup
    "${BENCH[@]}" "${SWEEP[@]}" --batch-size 8,32,64 --json "$OUT/sweep_bN.json" "${EXTRA[@]}" > "$OUT/sweep_bN.log" 2>&1
    echo "sweepN exit $?"; summary "$OUT/sweep_bN.log" 8
    ;;
  suites)
    setup
    # compare against the committed baselines (bench/baselines) when this machine kind has one; save a new one
    mkdir -p "$OUT/baselines" && cp -r bench/baselines/. "$OUT/baselines/" 2>/dev/null
    compare=()
    ls "$OUT"/baselines/Linux-CPython-3.12-64bit/*.json > /dev/null 2>&1 && compare=(--benchmark-compare)
    python3 -P -m pytest -p no:cacheprovider bench/bench_steps.py bench/bench_kernels.py \
      --benchmark-storage="file://$OUT/baselines" --benchmark-save=h200 "${compare[@]}" \
      --benchmark-columns=median,iqr,rounds > "$OUT/suites.log" 2>&1
    echo "suites exit $?"; tail -n 45 "$OUT/suites.log"
    ;;
  *)
    echo "unknown stage $stage: prep|correctness|sweep1|sweepN|suites" >&2; exit 2
    ;;
esac
