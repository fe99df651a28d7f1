#!/usr/bin/env bash
# The GPU runner: stages the model on the GPU machine in consecutive runs of the device tool (each run carries at
# most 64 MiB; the machine keeps /tmp between runs while it is up), then runs named rounds. bench/README.md has
# the whole procedure. Prepare here, from the repository root, on the CPU machine:
#   bash bench/gpu_session.sh prep     .stage3/p_00 .. p_02 (the model in 35 MB pieces), .whl (the specdec wheel,
#                                      blake3, gguf, commit.txt), .gpu/mtbench_ids.json (the prompt file)
# Then on the GPU machine (carry what is named):
#   1 (.stage3/p_00)                   bash bench/gpu_session.sh piece 00
#   2 (.stage3/p_01)                   bash bench/gpu_session.sh piece 01
#   3 (.stage3/p_02 .whl .gpu)         bash bench/gpu_session.sh piece 02 && bash bench/gpu_session.sh tests
#   4 (.whl .gpu, after 3)             bash bench/gpu_session.sh plan greedy 0
#   5 (.whl .gpu, after 3)             bash bench/gpu_session.sh plan t07 0.7   (and plan t10 1.0)
#   any run after 3 (.whl)             bash bench/gpu_session.sh suites
#   any run after 3 (.whl .gpu)        bash bench/gpu_session.sh profile
# Rounds: tests (the GPU tests of the step), plan NAME TEMPERATURE (ENGINES, default the CUDA defaults, cold and
# interleaved at batch 1, 16 and 64, or BATCHES), suites (the pytest-benchmark suites of bench/, compared with
# bench/baselines), profile (bench/gpu_profile.py: wall time against kernel time per step).
# Each round packs its logs and JSON into $OUT/<round>.tgz (the device tool returns at most 8 files) and prints
# a short summary last.
set -uo pipefail
stage=${1:?usage: gpu_session.sh prep | piece NN | tests | plan NAME TEMPERATURE | suites | profile}
OUT=${OUT:-/tmp/out}
MODEL=/tmp/model.gguf
root=$(pwd)
D="$OUT/$stage${2:+_$2}"

prep() {  # on the CPU machine: the model's pieces, the wheels and the prompt file (ignored by git); PYTHON: a Python
          # with specdec and its test extras installed (default python3)
  local py=${PYTHON:-python3} src tmp
  src=$("$py" -P -c "from specdec.loading.gguf_loader import smollm2_gguf_path; print(smollm2_gguf_path())") || return 1
  rm -rf build .whl .stage3 && mkdir -p .whl .gpu
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl blake3 gguf || return 1  # the GPU image lacks them (Python 3.12 there)
  "$py" -m pip wheel -q --no-deps -w .whl . && rm -rf build || return 1
  git describe --always --dirty > .whl/commit.txt
  tmp=$(mktemp -d) && split -b 35000000 -d "$src" "$tmp/piece."
  for p in "$tmp"/piece.*; do mkdir -p ".stage3/p_${p##*.}" && mv "$p" ".stage3/p_${p##*.}/"; done
  rmdir "$tmp"
  "$py" -P bench/gpu_interleaved.py --prompts .gpu/mtbench_ids.json
  ls -la .stage3/* .whl
}

install() {  # the carried wheels into /tmp/site; Python runs with -P so the checkout's folders do not shadow them
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "$root"/.whl/*.whl > "$D/pip.log" 2>&1
  export PYTHONPATH=/tmp/site
  [ -f "$root/.whl/commit.txt" ] && SPECDEC_GIT_COMMIT=$(cat "$root/.whl/commit.txt") && export SPECDEC_GIT_COMMIT
}

pack() {
  local name=${D##*/}
  tar czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "${OUT:?}/$name"
}

assemble() {  # the model from the pieces of runs 1-3
  cat /tmp/stage/piece.* > "$MODEL" && md5sum "$MODEL" | tee "$D/md5.txt"
}

gpu_tests() {  # gpu_tests SECONDS FILE...: the GPU test files into $D/tests.log (GPU_K: a -k filter)
  local limit=$1; shift
  timeout "$limit" python3 -P -m pytest -q -p no:cacheprovider "$@" ${GPU_TESTS:-} ${GPU_K:+-k "$GPU_K"} > "$D/tests.log" 2>&1
  echo "tests exit $?" >> "$D/tests.log"
  tail -3 "$D/tests.log"
}

interleaved() {  # interleaved SECONDS BATCH...: bench/gpu_interleaved.py into $D/interleaved.log
  local limit=$1; shift
  [ -d /tmp/site ] && export PYTHONPATH=/tmp/site
  (cd /tmp && timeout "$limit" python3 -P "$root/bench/gpu_interleaved.py" "$D" "$MODEL" "$root/.gpu/mtbench_ids.json" \
    "$@" > "$D/interleaved.log" 2>&1)
  echo "interleaved exit $?"
  grep -h "^interleaved" "$D/interleaved.log"
}

keep_interleaved() {  # keep_interleaved LOG JSON: the last interleaved run's log and JSON kept under these names in $D
  mv "$D/interleaved.log" "$D/$1"
  cp "$D/interleaved.json" "$D/$2" 2>/dev/null
}

plan_rounds() {  # plan_rounds NAME TEMPERATURE: ENGINES (default plan) cold and interleaved at batch 1, 16 and 64
  local name=$1 t=$2 b
  ENGINES=${ENGINES:-plan}
  for b in ${BATCHES:-1 16 64}; do
    case $b in
      1) COLD=1 ENGINES=$ENGINES TEMPERATURE=$t NUM_PROMPTS=24 REPEATS_B1=3 interleaved 150 1 ;;
      16) COLD=1 ENGINES=$ENGINES TEMPERATURE=$t SCHEDULES=continuous REPEATS=5 interleaved 150 16 ;;
      64) COLD=1 ENGINES=$ENGINES TEMPERATURE=$t SCHEDULES=continuous REPEATS=5 PROMPT_SET=sharegpt interleaved 150 64 ;;
    esac
    keep_interleaved "${name}_b$b.log" "${name}_b$b.json"
  done
}

suites() {  # the pytest-benchmark suites, compared with the committed baseline of this machine kind when there is one
  mkdir -p "$D/baselines" && cp -r "$root"/bench/baselines/. "$D/baselines/" 2>/dev/null
  local compare=()
  ls "$D"/baselines/Linux-CPython-3.12-64bit/*.json > /dev/null 2>&1 && compare=(--benchmark-compare)
  (cd "$root" && BENCH_MODEL=$MODEL timeout "${SUITES_LIMIT:-500}" python3 -P -m pytest -p no:cacheprovider \
    bench/bench_steps.py bench/bench_kernels.py bench/bench_decode.py \
    --benchmark-storage="file://$D/baselines" --benchmark-save=h200 "${compare[@]}" \
    --benchmark-columns=median,iqr,rounds > "$D/suites.log" 2>&1)
  echo "suites exit $?"; tail -n 45 "$D/suites.log"
}

[ "$stage" = prep ] && { prep; exit; }
mkdir -p "$D"
case "$stage" in
  piece)
    mkdir -p /tmp/stage && cp "$root"/.stage3/p_"$2"/* /tmp/stage/ && ls -la /tmp/stage
    rm -rf "${OUT:?}/$stage"
    ;;
  tests)  # (.whl, the model assembled, or .stage3/p_02 with piece 02) the GPU tests of the step: graphs, EAGLE, the
          # sampled rule, fused and pipelined steps, n-gram on the device, the warm-up
    [ -f "$MODEL" ] || assemble
    install
    GPU_K="gpu or cuda" gpu_tests "${TESTS_LIMIT:-240}" tests/test_step_graphs.py tests/test_eagle.py \
      tests/test_sampled_rule.py tests/test_fused_step.py tests/test_lookahead.py tests/test_ngram_device.py \
      tests/test_warm_up.py
    pack
    ;;
  plan)  # plan NAME TEMPERATURE (.whl .gpu, the model assembled or .stage3/p_02): ENGINES (default plan) cold and
         # interleaved at batch 1 (24 MT-bench), 16 (80 MT-bench) and 64 (200 ShareGPT-eval), continuous batching;
         # BATCHES: a subset of "1 16 64"
    [ -f "$MODEL" ] || assemble
    install
    plan_rounds "${2:?plan NAME TEMPERATURE}" "${3:?plan NAME TEMPERATURE}"
    pack
    ;;
  profile)  # (.whl .gpu, the model assembled or .stage3/p_02 with piece 02) bench/gpu_profile.py: wall time per step
             # against kernel time per step, per configuration (ONLY: a subset)
    [ -f "$MODEL" ] || assemble
    install
    (cd /tmp && timeout "${PROFILE_LIMIT:-420}" python3 -P "$root/bench/gpu_profile.py" "$D" "$MODEL" \
      "$root/.gpu/mtbench_ids.json" > "$D/profile.log" 2>&1)
    echo "profile exit $?"; grep -h "^profile\|Error\|error" "$D/profile.log" | tail -30
    pack
    ;;
  suites)  # (.whl, the model assembled on this machine) bench_steps, bench_kernels, bench_decode
    [ -f "$MODEL" ] || assemble
    install
    suites
    pack
    ;;
  *)
    echo "unknown stage $stage" >&2; exit 2
    ;;
esac
