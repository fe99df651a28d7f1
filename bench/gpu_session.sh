#!/usr/bin/env bash
# One session's GPU round on the H200, in consecutive runs of the device tool (the machine keeps /tmp
# between runs while it is up, about 30 s). Prepare here, from the repository root:
#   split -b 35000000 -d <SmolLM2 gguf> piece.   into .stage3/p_00 .. p_02 (one piece each, git-ignored)
#   rm -rf build .whl && pip wheel --no-deps . -w .whl   (+ the blake3 and gguf wheels from stage-model)
#   python -P bench/gpu_fastpath.py prompts .gpu/mtbench_ids.json; bash bench/gpu_honest.sh prep (mtbench.jsonl)
# Runs (carry what is named):
#   1 (.stage3/p_00)                 bash bench/gpu_session.sh piece 00
#   2 (.stage3/p_01)                 bash bench/gpu_session.sh piece 01
#   3 (.stage3/p_02 .whl .gpu)       bash bench/gpu_session.sh piece 02 && bash bench/gpu_session.sh core
#   4 (.whl .gpu)                    bash bench/gpu_session.sh eagle
#   5 (.stage-serve)                 bash bench/gpu_session.sh serve
#   6 (.whl)                         bash bench/gpu_session.sh sweep
#   7 (.whl .gpu, after core)        bash bench/gpu_session.sh adaptive   (n-gram chain:8, adaptive on/off; waves
#                                    and continuous batching; ADAPTIVE_BATCHES=16,64 for those batch sizes only)
#   8 (.whl .gpu, after core)        bash bench/gpu_session.sh dyntree    (device dynamic EAGLE trees, batch 1/64)
#   or run 3 as (.stage3/p_02 .whl .gpu) piece 02 && round1: GPU tests + adaptive at batch 16/64 (ADAPTIVE_BATCHES)
# Each stage packs its logs and JSON into $OUT/<stage>.tgz (the device tool returns at most 8 files) and
# prints a short summary last.
set -uo pipefail
stage=${1:?usage: gpu_session.sh piece NN | core | eagle | serve | sweep | adaptive | dyntree}
OUT=${OUT:-/tmp/out}
MODEL=/tmp/model.gguf
root=$(pwd)
mkdir -p "$OUT/$stage"
D="$OUT/$stage"

install() {
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "$root"/.whl/*.whl > "$D/pip.log" 2>&1
  export PYTHONPATH=/tmp/site
  [ -f "$root/.whl/commit.txt" ] && SPECDEC_GIT_COMMIT=$(cat "$root/.whl/commit.txt") && export SPECDEC_GIT_COMMIT
}

pack() {
  tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage" && rm -rf "${OUT:?}/$stage"
}

assemble() {  # the model from the pieces of runs 1-3
  cat /tmp/stage/piece.* > "$MODEL" && md5sum "$MODEL" | tee "$D/md5.txt"
}

gpu_tests() {  # gpu_tests SECONDS FILE...: the GPU test files into $D/tests.log
  local limit=$1; shift
  timeout "$limit" python3 -P -m pytest -q -p no:cacheprovider "$@" ${GPU_TESTS:-} ${GPU_K:+-k "$GPU_K"} > "$D/tests.log" 2>&1
  echo "tests exit $?" >> "$D/tests.log"
  tail -3 "$D/tests.log"
}

fastpath() {  # fastpath SECONDS MODE [ARGS...]: bench/gpu_fastpath.py MODE into $D/MODE.log (from /tmp)
  local limit=$1 mode=$2; shift 2
  (cd /tmp && timeout "$limit" python3 -P "$root/bench/gpu_fastpath.py" "$mode" "$D" "$@" > "$D/$mode.log" 2>&1)
}

eagle_round() {  # eagle_round SECONDS [tree-levels]: the eagle mode, optionally the tree-level timing, chi-square
  fastpath "$1" eagle "$MODEL" "$root/.gpu/mtbench_ids.json"
  [ "${2:-}" = tree-levels ] && (cd /tmp && timeout 40 python3 -P "$root/bench/gpu_tree_levels.py" "$D" \
    > "$D/tree_levels.log" 2>&1)
  (cd /tmp && timeout 150 python3 -P "$root/bench/chisq_real_draft.py" "$D" "$MODEL" "$root/.gpu/mtbench_ids.json" \
    20000 > "$D/chisq.log" 2>&1)
  grep -h -e "^eagle" "$D/eagle.log" | tail -20
  tail -3 "$D/chisq.log" | cut -c1-300
}

benchpy() {  # benchpy SECONDS LOG SCRIPT [ARGS...]: bench/SCRIPT from /tmp into $D/LOG
  local limit=$1 logname=$2 script=$3; shift 3
  (cd /tmp && timeout "$limit" python3 -P "$root/bench/$script" "$@" > "$D/$logname" 2>&1)
}

program_kernels() {  # program_kernels SECONDS: the draft programs' kernels (bench/gpu_program_kernels.py)
  benchpy "$1" kernels.log gpu_program_kernels.py "$D"
  grep -h -e "replay" "$D/kernels.log"
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

plan_rounds() {  # plan_rounds NAME TEMPERATURE: ENGINES=plan cold and interleaved at batch 1, 16 and 64 into $D/NAME_b*.*
  local name=$1 t=$2
  COLD=1 ENGINES=plan TEMPERATURE=$t NUM_PROMPTS=24 REPEATS_B1=3 interleaved 150 1; keep_interleaved "${name}_b1.log" "${name}_b1.json"
  COLD=1 ENGINES=plan TEMPERATURE=$t SCHEDULES=continuous REPEATS=5 interleaved 120 16; keep_interleaved "${name}_b16.log" "${name}_b16.json"
  COLD=1 ENGINES=plan TEMPERATURE=$t SCHEDULES=continuous REPEATS=5 PROMPT_SET=sharegpt interleaved 120 64; keep_interleaved "${name}_b64.log" "${name}_b64.json"
}

case "$stage" in
  piece)
    mkdir -p /tmp/stage && cp "$root"/.stage3/p_"$2"/* /tmp/stage/ && ls -la /tmp/stage
    rm -rf "${OUT:?}/$stage"
    ;;
  core)
    assemble
    install
    nvidia-smi > "$D/nvidia-smi.txt" 2>&1
    gpu_tests 180 tests/test_step_graphs.py tests/test_eagle.py tests/test_kernels_kv_movement.py \
      tests/test_engine_triton.py tests/test_acceptance_stochastic_batch.py
    (cd /tmp && timeout 60 python3 -P "$root/bench/gpu_accept.py" "$D" > "$D/accept.log" 2>&1)
    fastpath 130 micro
    fastpath 230 adaptive "$MODEL" "$root/.gpu/mtbench_ids.json"
    grep -h -e "ms/step" -e "host ms" "$D/micro.log" | tail -8
    grep -h -e "^adaptive" -e "^batch" "$D/adaptive.log" | tail -14
    pack
    ;;
  round2)  # after a crash in core: the GPU tests from test_eagle on, then the eagle stage
    assemble
    install
    gpu_tests 120 tests/test_eagle.py tests/test_kernels_kv_movement.py tests/test_engine_triton.py \
      tests/test_acceptance_stochastic_batch.py tests/test_dynamic_frontier.py
    eagle_round 300
    pack
    ;;
  round1)  # session 4: the model from runs 1-3, the GPU tests after the last refactors, then the adaptive stage
    assemble
    install
    gpu_tests 200 tests/test_step_graphs.py tests/test_eagle.py tests/test_engine_triton.py \
      tests/test_acceptance_stochastic_batch.py tests/test_kernels_rope_backend.py tests/test_dynamic_frontier.py \
      tests/test_kernels_kv_movement.py
    ADAPTIVE_BATCHES=${ADAPTIVE_BATCHES:-16,64} fastpath 330 adaptive "$MODEL" "$root/.gpu/mtbench_ids.json"
    grep -h -e "^adaptive" -e "^batch" "$D/adaptive.log" | tail -20
    pack
    ;;
  round2s4)  # session 4 run 3 (with piece 02): GPU tests after the helpers' merges, n-gram batch 16/64 (waves + continuous)
    assemble
    install
    gpu_tests 150 tests/test_step_graphs.py tests/test_eagle.py tests/test_eagle_dynamic.py tests/test_eagle_features.py \
      tests/test_engine_triton.py tests/test_adaptive.py
    ADAPTIVE_BATCHES=${ADAPTIVE_BATCHES:-16,64} fastpath 200 adaptive "$MODEL" "$root/.gpu/mtbench_ids.json"
    grep -h -e "^adaptive" -e "^batch" "$D/adaptive.log" | tail -20
    pack
    ;;
  final4)  # session 4 run 3 (with piece 02): GPU tests after the prefill graphs, n-gram batch 1/16/64, eagle b1/b64
    assemble
    install
    gpu_tests 120 tests/test_step_graphs.py tests/test_eagle.py tests/test_engine_triton.py tests/test_adaptive.py
    ADAPTIVE_BATCHES=${ADAPTIVE_BATCHES:-1,16,64} fastpath 280 adaptive "$MODEL" "$root/.gpu/mtbench_ids.json"
    grep -h -e "^adaptive" -e "^batch" "$D/adaptive.log" | tail -22
    (cd /tmp && timeout 150 python3 -P "$root/bench/gpu_eagle_dynamic.py" speed "$D" "$MODEL" \
      "$root/.gpu/mtbench_ids.json" ${DYN_TREES:-dynamic:31 topk:2x3} > "$D/speed.log" 2>&1)
    grep -h -e "^batch" -e "^eagle" "$D/speed.log" | tail -8
    pack
    ;;
  s5a)  # session 5 run 3 (with piece 02): GPU tests (the shared capture helper, the shared n-gram table), then
        # n-gram at batch 16 interleaved (waves + continuous; shared table on/off, adaptive)
    assemble
    install
    gpu_tests 180 tests/test_step_graphs.py tests/test_eagle.py tests/test_engine_triton.py tests/test_adaptive.py \
      tests/test_ngram_shared.py
    interleaved 330 16
    pack
    ;;
  s5c)  # session 5, a fresh machine's run 3 (with piece 02) after s5a's tests: n-gram at batch 16 interleaved
    assemble
    install
    interleaved 330 16
    pack
    ;;
  s5d)  # session 5 round 2, run 3 (with piece 02): GPU tests incl. the fused EAGLE step, then EAGLE speed fused/unfused
    assemble
    install
    gpu_tests 150 tests/test_fused_step.py tests/test_eagle.py tests/test_eagle_dynamic.py tests/test_adaptive.py \
      tests/test_step_graphs.py tests/test_ngram_shared.py
    (cd /tmp && UNFUSED=${UNFUSED:-dynamic:31 adaptive} timeout 360 python3 -P "$root/bench/gpu_eagle_dynamic.py" speed \
      "$D" "$MODEL" "$root/.gpu/mtbench_ids.json" ${DYN_TREES:-dynamic:31 topk:2x3} > "$D/speed.log" 2>&1)
    echo "speed exit $?"
    grep -h -e "^batch" -e "^eagle" "$D/speed.log" | tail -14
    pack
    ;;
  s5e)  # session 5 round 2, run 4: n-gram at batch 16 and 1 interleaved (after s5d)
    install
    interleaved 500 16 1
    pack
    ;;
  s5f)  # session 5 round 3, run 3 (with piece 02): EAGLE at batch 64 interleaved (topk:2x3 fused/unfused, dynamic:31)
    assemble
    install
    ENGINES=eagle interleaved 480 64
    pack
    ;;
  s5m)  # session 5: bench/gpu_fastpath.py micro alone (random weights, no model staging): issue 9's step, verify
        # and host figures on the current code, graph replays at batch 16 by query length
    install
    fastpath 200 micro
    grep -h -e "ms/step" -e "host ms" -e "replay" "$D/micro.log" | tail -24
    pack
    ;;
  s5g)  # session 5 last round, run 3 (with piece 02): GPU tests of the fused step (captured tree building), the draft
        # program's kernels, EAGLE at batch 64 (5 rounds) and 1 (2 rounds) interleaved
    assemble
    install
    gpu_tests 120 tests/test_fused_step.py tests/test_eagle.py tests/test_eagle_dynamic.py tests/test_step_graphs.py
    program_kernels 60
    mkdir -p "$D/b64" "$D/b1"
    (D=$D/b64; export REPEATS=5 ENGINES=eagle; interleaved 170 64)
    (D=$D/b1; export REPEATS_B1=2 ENGINES=eagle; interleaved 190 1)
    pack
    ;;
  s5h)  # session 5, no model needed: the draft program's kernels after the fused norms, then the EAGLE GPU tests
    install
    program_kernels 60
    GPU_TESTS="-k gpu" gpu_tests 80 tests/test_fused_step.py tests/test_eagle.py
    pack
    ;;
  s6a)  # session 6, no model needed: GPU tests of the greedy head, graphs, fused step (tree graphs captured at start)
        # and the draft norms; the verify step's kernels by bucket; the draft program's kernels
    install
    gpu_tests 300 tests/test_kernels_greedy_head.py tests/test_kernels_norm_act.py tests/test_step_graphs.py \
      tests/test_fused_step.py tests/test_eagle.py tests/test_eagle_dynamic.py tests/test_engine_triton.py
    benchpy 150 verify_kernels.log gpu_verify_kernels.py "$D"
    grep -h -e "replay" -e "head" "$D/verify_kernels.log"
    program_kernels 60
    pack
    ;;
  s6b)  # session 6 round 2, run 3 (with piece 02): GPU tests of the fused verify head and acceptance, graphs, fused
        # step, Triton engine, stochastic batch; n-gram at batch 16 interleaved (waves and continuous, 7 rounds)
    assemble
    install
    gpu_tests 170 tests/test_kernels_greedy_head.py tests/test_kernels_greedy_accept.py tests/test_step_graphs.py \
      tests/test_fused_step.py tests/test_engine_triton.py tests/test_acceptance_stochastic_batch.py
    interleaved 400 16
    pack
    ;;
  s6c)  # session 6 round 2, run 4: n-gram at batch 1 interleaved (3 rounds), then issue 9's step figures (micro)
    install
    interleaved 280 1
    fastpath 200 micro
    grep -h -e "ms/step" -e "host ms" -e "replay" "$D/micro.log" | tail -24
    pack
    ;;
  s6d)  # session 6 round 3, run 3 (with piece 02): GPU tests (Triton top-k in the draft programs, the verify head and
        # acceptance kernels, tree graphs at start); the top-k kernel timing; the draft programs' kernels; EAGLE at
        # batch 64 (5 rounds) and batch 1 (2 rounds) interleaved
    assemble
    install
    gpu_tests 200 tests/test_kernels_topk.py tests/test_kernels_greedy_head.py tests/test_kernels_greedy_accept.py \
      tests/test_eagle.py tests/test_eagle_dynamic.py tests/test_fused_step.py tests/test_engine_triton.py
    benchpy 60 topk.log gpu_topk.py "$D"
    tail -12 "$D/topk.log"
    program_kernels 60
    mkdir -p "$D/b64" "$D/b1"
    (D=$D/b64; export REPEATS=5 ENGINES=eagle; interleaved 120 64)
    (D=$D/b1; export REPEATS_B1=2 ENGINES=eagle; interleaved 150 1)
    pack
    ;;
  s6e)  # session 6 round 3, run 4: n-gram at batch 16 interleaved (7 rounds), then issue 9's step figures (micro)
    install
    interleaved 200 16
    fastpath 150 micro
    grep -h -e "ms/step" -e "host ms" "$D/micro.log" | tail -8
    pack
    ;;
  s6f)  # session 6, run 3 (with piece 02): bisect the batch-64 EAGLE fault (bench/gpu_debug_fault.py), the first
        # configuration with CUDA_LAUNCH_BLOCKING=1
    assemble
    install
    gpu_tests 60 tests/test_kernels_topk.py
    for cfg in adaptive adaptive-noprepare adaptive-torchtopk adaptive-unfused fixed topk-adaptive; do
      blocking=0; [ "$cfg" = adaptive ] && blocking=1
      (cd /tmp && CUDA_LAUNCH_BLOCKING=$blocking timeout 90 python3 -P "$root/bench/gpu_debug_fault.py" "$D" "$MODEL" \
        "$root/.gpu/mtbench_ids.json" "$cfg" > "$D/fault_$cfg.log" 2>&1)
      grep -h -e " ok" -e "FAILED" -e "Error" "$D/fault_$cfg.log" | head -3
    done
    pack
    ;;
  s6g)  # session 6 last round, run 3 (with piece 02): GPU tests after the helpers' merges (kernels first); n-gram at
        # batch 16 interleaved (7 rounds); the draft programs' kernels
    assemble
    install
    gpu_tests 100 tests/test_kernels_topk.py tests/test_kernels_tree_choose.py tests/test_kernels_tree_slots.py \
      tests/test_kernels_norm_act.py tests/test_fused_step.py tests/test_eagle_dynamic.py tests/test_step_graphs.py \
      tests/test_engines_share_models.py tests/test_eagle.py
    interleaved 150 16
    program_kernels 50
    pack
    ;;
  s6h)  # session 6 last round, run 4a: EAGLE at batch 1 (2 rounds) and top-k trees at batch 64 (3 rounds) interleaved
    install
    mkdir -p "$D/b1" "$D/b64t"
    (D=$D/b1; export REPEATS_B1=2 ENGINES=eagle_b1; interleaved 130 1)
    (D=$D/b64t; export REPEATS=3 ENGINES=eagle_topk; interleaved 80 64)
    pack
    ;;
  s6i)  # session 6 last round, run 4b: target-only vs transformers' static compiled generate (issue 9's first item)
    install
    fastpath 130 hfcompare "$MODEL" "$root/.gpu/mtbench_ids.json"
    grep -h -e "^hfcompare" "$D/hfcompare.log" | tail -4
    pack
    ;;
  s7a)  # next session's first round, run 3 (with piece 02): the GPU tests session 6's last wheel did not run (graph
        # replay == eager, EAGLE, four engines over shared models, the top-k reference fix), then the fused EAGLE
        # step's host profile on the H200 host, then transformers' static compiled generate beside target-only
    assemble
    install
    gpu_tests 200 tests/test_kernels_topk.py tests/test_step_graphs.py tests/test_engines_share_models.py \
      tests/test_eagle.py
    benchpy 150 host_profile.log host_profile.py --device cuda --batches 1 64 --modes decode eagle --steps 30 \
      --warmup 10 --new-tokens 1024 --gguf "$MODEL" --out "$D/host_profile_cuda.json"
    grep -h -e "^| " "$D/host_profile.log" | tail -6
    fastpath 150 hfcompare "$MODEL" "$root/.gpu/mtbench_ids.json"
    grep -h -e "^hfcompare" "$D/hfcompare.log" | tail -4
    pack
    ;;
  s7b)  # session 7 run 3 (with piece 02): GPU tests of the pipelined fused step, then EAGLE pipelined vs unpipelined vs
        # target-only at batch 1 (3 rounds) and 64 (3 rounds), interleaved
    assemble
    install
    gpu_tests 170 tests/test_lookahead.py tests/test_eagle.py tests/test_fused_step.py tests/test_engines_share_models.py
    export ENGINES=pipeline REPEATS=3
    interleaved 370 1 64
    pack
    ;;
  s7c)  # (.whl .gpu; the model assembled by s7b, or pieces staged) the pipelined step: host syncs at batch 1, EAGLE
        # pipelined vs unpipelined at batch 1 (interleaved), then a batch-64 run with CUDA_LAUNCH_BLOCKING=1
    [ -f "$MODEL" ] || assemble
    install
    benchpy 80 syncs.log gpu_pipeline_debug.py syncs "$D" "$MODEL" "$root/.gpu/mtbench_ids.json"
    grep -h -e "^sync" -e "^paths" "$D/syncs.log" | head -20
    export ENGINES=pipeline REPEATS_B1=2
    interleaved 240 1
    export CUDA_LAUNCH_BLOCKING=1
    benchpy 150 batch64.log gpu_pipeline_debug.py batch "$D" "$MODEL" "$root/.gpu/mtbench_ids.json" 64
    grep -h -e "^batch" "$D/batch64.log" | tail -4
    grep -h -B2 -A30 "Traceback" "$D/batch64.log" | head -60
    pack
    ;;
  s7d)  # (.whl .gpu; model already assembled) batch 64 dynamic:63 pipelined with blocking launches, then batch 1
        # pipelined vs unpipelined, 3 interleaved rounds
    [ -f "$MODEL" ] || assemble
    install
    export CUDA_LAUNCH_BLOCKING=1
    benchpy 150 b64_dyn63.log gpu_pipeline_debug.py batch "$D" "$MODEL" "$root/.gpu/mtbench_ids.json" 64 dynamic:63
    grep -h -e "^batch" "$D/b64_dyn63.log" | tail -3
    unset CUDA_LAUNCH_BLOCKING
    export ENGINES=pipeline REPEATS_B1=3
    interleaved 260 1
    pack
    ;;
  s7e)  # session 7 run 3 of a fresh machine (with piece 02): GPU tests of the pipelined step (its advance now one
        # graph), then EAGLE pipelined vs unpipelined vs target-only at batch 1, 2 interleaved rounds
    assemble
    install
    gpu_tests 110 tests/test_lookahead.py tests/test_eagle.py -k "lookahead or gpu or pipeline"
    export ENGINES=pipeline REPEATS_B1=2
    interleaved 200 1
    pack
    ;;
  s8a)  # next session, run 3 (with piece 02): the GPU tests of what session 7 added after its last GPU run (the
        # advance kernel, depths read with the trees, pinned block-table uploads), then the pipeline against the
        # unpipelined step at batch 1 and 64 (s7b's four engines in one process, where it faulted once), interleaved
    assemble
    install
    gpu_tests 150 tests/test_kernels_advance.py tests/test_lookahead.py tests/test_fused_step.py \
      tests/test_engines_share_models.py tests/test_eagle.py -k "advance or lookahead or gpu or share"
    ENGINES=pipeline REPEATS_B1=3 interleaved 260 1 && keep_interleaved interleaved_b1.log interleaved_b1.json
    ENGINES=pipeline64 REPEATS=3 interleaved 200 64
    pack
    ;;
  s8c)  # (.stage3/p_02 .whl .gpu, with piece 02) the batch-64 fault's fix (specdec/graph_constants.py): GPU tests
        # of the cached constants under captured graphs, then s8a's batch-64 engine set again
    assemble
    install
    gpu_tests 200 tests/test_graph_constants.py tests/test_fused_step.py tests/test_lookahead.py \
      -k "gpu or constant or lookahead"
    ENGINES=pipeline64 REPEATS=3 interleaved 330 64
    pack
    ;;
  s8d)  # (.stage3/p_02 .whl .gpu, with piece 02) s8c's failed batch-64 waves, with every failure's cause logged:
        # all engines in one process, two engines alone, then all under CUDA_LAUNCH_BLOCKING; then the GPU tests
    assemble
    install
    export ENGINES=pipeline64 SCHEDULES=waves REPEATS=2
    interleaved 150 64; mv "$D/interleaved.log" "$D/waves_all.log"
    ONLY=eagle_dynamic15 interleaved 80 64; mv "$D/interleaved.log" "$D/waves_dyn15.log"
    ONLY=eagle_dynamic31_unpipelined interleaved 80 64; mv "$D/interleaved.log" "$D/waves_unpiped.log"
    CUDA_LAUNCH_BLOCKING=1 REPEATS=1 interleaved 150 64; mv "$D/interleaved.log" "$D/waves_blocking.log"
    gpu_tests 100 tests/test_graph_constants.py tests/test_fused_step.py -k "outlive or constant"
    grep -h -c FAILED "$D"/waves_*.log
    pack
    ;;
  s8e)  # (.stage3/p_02 .whl .gpu, with piece 02) the engine's new CUDA defaults (pipelined, fixed budget): GPU tests,
        # then ENGINES=defaults interleaved at batch 1 and 64 (KV pools of 3 GiB per engine: no OOM)
    assemble
    install
    gpu_tests 120 tests/test_graph_constants.py tests/test_fused_step.py tests/test_lookahead.py tests/test_eagle.py \
      tests/test_engines_share_models.py -k "gpu or outlive or constant or lookahead or share"
    ENGINES=defaults REPEATS_B1=3 interleaved 220 1 && keep_interleaved interleaved_b1.log interleaved_b1.json
    ENGINES=defaults REPEATS=5 interleaved 180 64
    grep -h -c FAILED "$D"/interleaved*.log
    pack
    ;;
  s8f)  # (.stage3/p_02 .whl .gpu, with piece 02) the CUDA defaults between batch 1 and 64: batch 8 and 32
    assemble
    install
    ENGINES=defaults_mid REPEATS=3 interleaved 200 8 32
    grep -h -c FAILED "$D"/interleaved.log
    pack
    ;;
  s8b)  # (.whl .gpu, after s8a on the same machine) issue 9's n-gram chain:8 at batch 16, waves and continuous
    [ -f "$MODEL" ] || assemble
    install
    ENGINES=ngram REPEATS=7 interleaved 240 16
    pack
    ;;
  s9a)  # (.stage3/p_02 .whl .gpu, with piece 02) the GPU tests of session 8's last commits (the controller for
        # sampled steps beside pipelined greedy steps, the churn test's AdvanceGraphs check), then issue 9's n-gram
        # at batch 16 after helper-21's host cuts: chain:8 / 4 / 3 fixed and chain:8 adaptive, waves and continuous
    assemble
    install
    gpu_tests 150 tests/test_graph_constants.py tests/test_fused_step.py tests/test_lookahead.py tests/test_eagle.py \
      tests/test_engines_share_models.py -k "gpu or outlive or constant or lookahead or share"
    ENGINES=ngram_len REPEATS=7 interleaved 330 16
    grep -h -c FAILED "$D"/interleaved.log
    pack
    ;;
  s9b)  # (.whl .gpu, after s9a on the same machine) s9a's engines at batch 1, then where a batch-16 n-gram step's
        # time goes on the H200 (the real model on MT-bench prompts; decode beside chain:8 and chain:4)
    [ -f "$MODEL" ] || assemble
    install
    ENGINES=ngram_len REPEATS_B1=3 interleaved 250 1
    TIMELINE_MODEL=$MODEL TIMELINE_PROMPTS=$root/.gpu/mtbench_ids.json benchpy 150 timeline.log \
      gpu_step_timeline.py "$D" decode::16 ngram:chain:8:16 ngram:chain:4:16
    grep -h -e "ms/step" "$D/timeline.log"
    pack
    ;;
  s9c)  # (.stage3/p_02 .whl .gpu, with piece 02) where the batch-16 n-gram step's extra time goes on the H200: the
        # host profile with the real model on MT-bench prompts (graph launch and GPU wait timed apart from the host)
    assemble
    install
    benchpy 200 host_profile.log host_profile.py --device cuda --batches 16 --modes decode ngram --fixed --finals \
      --target "$MODEL" --steps 40 --warmup 10 --new-tokens 400 --top 45 --prompts "$root/.whl/mtbench.jsonl" \
      --out "$D/host_profile_cuda.json"
    grep -h -e "^| " -e "FORWARD" "$D/host_profile.log" | tail -12
    pack
    ;;
  s9d)  # (.stage3/p_02 .whl .gpu, with piece 02) n-gram chains looked up on the device: its GPU tests (the kernel
        # at real history lengths, float32 engines with graphs), then issue 9's batch 16 against the host lookup
    assemble
    install
    gpu_tests 200 tests/test_ngram_device.py tests/test_step_graphs.py
    ENGINES=ngram_device REPEATS=7 interleaved 330 16
    grep -h -c FAILED "$D"/interleaved.log
    pack
    ;;
  s9e)  # (.whl .gpu, after s9d on the same machine) the batch-16 n-gram step's time: decode, host and device lookup
    [ -f "$MODEL" ] || assemble
    install
    TIMELINE_MODEL=$MODEL TIMELINE_PROMPTS=$root/.gpu/mtbench_ids.json benchpy 150 timeline.log \
      gpu_step_timeline.py "$D" decode::16 ngram-host:chain:8:16 ngram:chain:8:16
    grep -h -e "ms/step" "$D/timeline.log"
    pack
    ;;
  s9f)  # (.stage3/p_02 .whl .gpu, with piece 02) the final device-lookup wheel: its GPU tests, then issue 9's batch 16
    assemble
    install
    gpu_tests 150 tests/test_ngram_device.py tests/test_step_graphs.py -k "ngram or gpu"
    ENGINES=ngram_final REPEATS=7 interleaved 330 16
    grep -h -c FAILED "$D"/interleaved.log
    pack
    ;;
  s9g)  # (.whl .gpu, after s9f on the same machine) batch 1 (the default engine there looks up on the host) and 64
    [ -f "$MODEL" ] || assemble
    install
    ENGINES=ngram_final ONLY="ngram_device" REPEATS_B1=3 interleaved 200 1 && \
      keep_interleaved b1.log interleaved_b1.json
    ENGINES=ngram_final REPEATS=3 interleaved 250 64
    grep -h "^interleaved" "$D/b1.log"
    pack
    ;;
  s9h)  # (.stage3/p_02 .whl .gpu, with piece 02) pipelined greedy steps of more than 16 rows keep dynamic:31's best
        # 15 nodes: test_lookahead on CUDA (float32, graphs), then batch 64 against dynamic:31 at full size
    assemble
    install
    gpu_tests 150 tests/test_lookahead.py
    ENGINES=large_batch REPEATS=5 interleaved 300 64
    grep -h -c FAILED "$D"/interleaved.log
    pack
    ;;
  s9i)  # (.stage3/p_02 .whl .gpu, with piece 02) sampled decoding (T = 0.7, top-p 0.9) with the CUDA defaults: the
        # shipped draft and n-gram against target-only, batch 1 and 16 (waves)
    assemble
    install
    export ENGINES=sampled TEMPERATURE=0.7 SCHEDULES=waves
    REPEATS_B1=3 interleaved 200 1 && keep_interleaved b1.log interleaved_b1.json
    REPEATS=3 interleaved 120 16
    grep -h "^interleaved" "$D/b1.log"
    grep -h -c FAILED "$D"/*.log
    pack
    ;;
  s10a)  # (.stage3/p_02 .whl .gpu, with piece 02) session 10: the GPU tests of session 9's last commits, then where a
         # sampled step's time goes (T = 0.7, top-p 0.9, real model, 16 MT-bench rows): target-only, n-gram and the
         # shipped draft, greedy beside sampled
    assemble
    install
    GPU_K="gpu or ngram or lookahead or outlive" gpu_tests 200 tests/test_ngram_device.py \
      tests/test_step_graphs.py tests/test_lookahead.py tests/test_fused_step.py
    TIMELINE_MODEL=$MODEL TIMELINE_PROMPTS=$root/.gpu/mtbench_ids.json benchpy 100 timeline_greedy.log \
      gpu_step_timeline.py "$D/greedy" decode::16 ngram:chain:8:16
    TIMELINE_TEMPERATURE=0.7 TIMELINE_MODEL=$MODEL TIMELINE_PROMPTS=$root/.gpu/mtbench_ids.json benchpy 150 \
      timeline_sampled.log gpu_step_timeline.py "$D/sampled" decode::16 decode::4 ngram:chain:8:16 eagle:dynamic:31:16
    grep -h -e "ms/step" "$D"/timeline_*.log
    pack
    ;;
  s10c)  # (.stage3/p_02 .whl .gpu, with piece 02) pipelined n-gram steps: the GPU tests (float32, graphs), then
         # batch 16 (waves and continuous) and batch 1 interleaved against target-only and the unpipelined paths
    [ -f "$MODEL" ] || assemble
    install
    gpu_tests 200 tests/test_ngram_device.py tests/test_lookahead.py
    ENGINES=ngram_pipeline REPEATS=7 interleaved 200 16 && keep_interleaved b16.log interleaved_b16.json
    ENGINES=ngram_pipeline ONLY="ngram_host ngram_pipelined_any" REPEATS_B1=3 interleaved 170 1
    grep -h "^interleaved" "$D/b16.log"
    grep -h -c FAILED "$D"/*.log
    pack
    ;;
  s10d)  # (.whl .gpu, after a stage that assembled the model on this machine) pipelined n-gram steps adopted by the
         # rows left when others finish: GPU tests, then batch 16 (waves, continuous) and 64 against target-only
    [ -f "$MODEL" ] || assemble
    install
    gpu_tests 150 tests/test_ngram_device.py
    ENGINES=ngram_pipeline ONLY="ngram_device ngram_pipelined" REPEATS=5 interleaved 150 16 && \
      keep_interleaved b16.log interleaved_b16.json
    ENGINES=ngram_pipeline ONLY="ngram_device ngram_pipelined" REPEATS=3 interleaved 150 64
    grep -h "^interleaved" "$D/b16.log"
    grep -h -c FAILED "$D"/*.log
    pack
    ;;
  s10e)  # (.stage3/p_02 .whl .gpu, with piece 02) the pipelined n-gram advance captured once per (bucket, source
         # bucket): GPU tests, then batch 16 and 64 against target-only (waves, continuous)
    [ -f "$MODEL" ] || assemble
    install
    gpu_tests 150 tests/test_ngram_device.py tests/test_sampled_rule.py
    ENGINES=ngram_pipeline ONLY="ngram_pipelined" REPEATS=5 interleaved 120 16 && \
      keep_interleaved b16.log interleaved_b16.json
    ENGINES=ngram_pipeline ONLY="ngram_device ngram_pipelined" REPEATS=5 interleaved 200 64
    grep -h "^interleaved" "$D/b16.log"
    grep -h -c FAILED "$D"/*.log
    pack
    ;;
  s10f)  # (.stage3/p_02 .whl .gpu, with piece 02) session 10's final wheel: the GPU tests of everything the session
         # touched (float32 graph replay == eager, graphed EAGLE == target-only, the sampled rule, the pipelines,
         # the Triton engine), then pipelined target-only decoding at batch 16 and 1 (opt-in) against the default
    [ -f "$MODEL" ] || assemble
    install
    GPU_K="gpu or ngram or sampled or stream or lookahead or pipelined or triton" gpu_tests 220 \
      tests/test_step_graphs.py tests/test_eagle.py tests/test_sampled_rule.py tests/test_uniform_stream.py \
      tests/test_ngram_device.py tests/test_lookahead.py tests/test_engine_triton.py
    ENGINES=decode_pipeline REPEATS=5 interleaved 130 16 && keep_interleaved b16.log interleaved_b16.json
    ENGINES=decode_pipeline ONLY=target_only_pipelined REPEATS_B1=3 interleaved 110 1
    grep -h "^interleaved" "$D/b16.log"
    grep -h -c FAILED "$D"/*.log
    pack
    ;;
  s10g)  # (.whl .gpu, right after s10f on the same machine) sampled steps and sampled n-gram at batch 16
    [ -f "$MODEL" ] || assemble
    install
    TIMELINE_TEMPERATURE=0.7 TIMELINE_MODEL=$MODEL TIMELINE_PROMPTS=$root/.gpu/mtbench_ids.json benchpy 90 \
      timeline_sampled.log gpu_step_timeline.py "$D/sampled" decode::16 ngram:chain:8:16
    ENGINES=sampled ONLY=ngram_chain8 TEMPERATURE=0.7 SCHEDULES=waves REPEATS=3 interleaved 80 16
    grep -h -e "ms/step" "$D"/timeline_*.log
    pack
    ;;
  s12a)  # (.stage3/p_02 .whl .gpu, with piece 02) issue 25, round 1: GPU tests of the plan and the device-drafted
         # sampled rows, then the CUDA defaults interleaved (cold first round) at batch 1 (24 MT-bench), 16 (80
         # MT-bench) and 64 (200 ShareGPT-eval), continuous batching, greedy
    [ -f "$MODEL" ] || assemble
    install
    GPU_K="gpu or cuda" gpu_tests 200 tests/test_step_graphs.py tests/test_eagle.py tests/test_sampled_rule.py \
      tests/test_fused_step.py tests/test_lookahead.py tests/test_ngram_device.py
    plan_rounds greedy 0
    pack
    ;;
  s12b)  # (.whl .gpu, after s12a) the same rounds sampled: T = 0.7 top-p 0.9, then T = 1.0
    [ -f "$MODEL" ] || assemble
    install
    plan_rounds t07 0.7
    plan_rounds t10 1.0
    pack
    ;;
  s11a)  # (.stage3/p_02 .whl .gpu, with piece 02) next session: should target-only decoding be pipelined by default?
         # target-only unpipelined and pipelined, pipelined n-gram and the shipped draft (CUDA defaults), interleaved
         # at batch 1, 16 and 64; then compare each speculative engine with target_only_pipelined per round
    [ -f "$MODEL" ] || assemble
    install
    ENGINES=decode_flip REPEATS_B1=3 interleaved 300 1 && keep_interleaved b1.log interleaved_b1.json
    ENGINES=decode_flip REPEATS=5 interleaved 250 16 64
    grep -h "^interleaved" "$D/b1.log"
    pack
    ;;
  s10b)  # (.stage3/p_02 .whl .gpu, with piece 02, or after a stage that assembled the model) the captured sampled
         # rule (specdec.sampled_rule, counter-based uniforms): its GPU tests (real graphs: rule replay == eager ==
         # CPU, engine graphed == eager, stream bits GPU == CPU), then the sampled step's time (T = 0.7, top-p 0.9)
         # beside greedy decode::16, then sampled n-gram against sampled target-only at batch 16 (waves)
    [ -f "$MODEL" ] || assemble
    install
    GPU_K="gpu or test_sampled_rule or test_uniform_stream" gpu_tests 140 tests/test_uniform_stream.py \
      tests/test_sampled_rule.py tests/test_acceptance_stochastic_batch.py tests/test_step_graphs.py
    TIMELINE_MODEL=$MODEL TIMELINE_PROMPTS=$root/.gpu/mtbench_ids.json benchpy 50 timeline_greedy.log \
      gpu_step_timeline.py "$D/greedy" decode::16
    TIMELINE_TEMPERATURE=0.7 TIMELINE_MODEL=$MODEL TIMELINE_PROMPTS=$root/.gpu/mtbench_ids.json benchpy 110 \
      timeline_sampled.log gpu_step_timeline.py "$D/sampled" decode::16 decode::4 ngram:chain:8:16
    ENGINES=sampled ONLY=ngram_chain8 TEMPERATURE=0.7 SCHEDULES=waves REPEATS=3 interleaved 90 16
    grep -h -e "ms/step" "$D"/timeline_*.log
    pack
    ;;
  timeline)  # (.whl) where a step's wall time goes: GPU busy vs idle, idle time by host function (random weights)
    install
    benchpy "${TIMELINE_LIMIT:-420}" timeline.log gpu_step_timeline.py "$D" ${TIMELINE_CASES:-decode::1 \
      eagle:dynamic:31:1 eagle+pipe:dynamic:31:1 eagle+pipe:dynamic:63:1 decode::64 eagle+pipe:dynamic:31:64}
    grep -h -e "ms/step" "$D/timeline.log"
    pack
    ;;
  hostprof)  # (.whl .gpu) host_profile.py on the H200 host: decode and EAGLE (topk:2x3, dynamic:31), batch 1 and 64
    install
    benchpy 300 host_profile.log host_profile.py --device cuda --batches 1 64 --modes decode eagle eagle-dynamic \
      --steps 30 --warmup 10 --new-tokens 1024 --tokenizer "$root/.gpu/tokenizer" --top 45 \
      --prompts "$root/.whl/mtbench.jsonl" \
      --out "$D/host_profile_cuda.json"
    grep -h -e "^| " "$D/host_profile.log" | tail -8
    pack
    ;;
  s5b)  # session 5 run 4 (after s5a/s5c): n-gram at batch 1 and 64 interleaved
    install
    interleaved 450 1 64
    pack
    ;;
  adaptive)  # ADAPTIVE_BATCHES=16,64 limits the batch sizes (default 1, 16, 64)
    [ -f "$MODEL" ] || assemble  # a fresh machine: the pieces of runs 1-3 must be in /tmp/stage
    install
    fastpath "${ADAPTIVE_LIMIT:-540}" adaptive "$MODEL" "$root/.gpu/mtbench_ids.json"
    grep -h -e "^adaptive" -e "^batch" "$D/adaptive.log" | tail -20
    pack
    ;;
  dyntree)  # the device program's dynamic trees: GPU tests, then tok/s + MAL at batch 1 and 64 vs target-only
    [ -f "$MODEL" ] || assemble
    install
    gpu_tests 90 tests/test_eagle.py -k "gpu_graphed or device_dynamic"
    (cd /tmp && timeout 420 python3 -P "$root/bench/gpu_eagle_dynamic.py" speed "$D" "$MODEL" \
      "$root/.gpu/mtbench_ids.json" ${DYN_TREES:-} > "$D/speed.log" 2>&1)
    grep -h -e "^batch" -e "^eagle" "$D/speed.log" | tail -14
    pack
    ;;
  eagle)
    install
    eagle_round 380 tree-levels
    pack
    ;;
  serve)
    cd "$root" && OUT="$D" BUDGET_S=${BUDGET_S:-420} NUM_PROMPTS=${NUM_PROMPTS:-100} bash bench/serve_gpu.sh > "$D/run.log" 2>&1
    tail -20 "$D/run.log"
    pack
    ;;
  sweep)
    install
    cd "$root" && OUT="$D" bash bench/gpu_honest.sh sweep1 > "$D/sweep1.out" 2>&1
    cd "$root" && OUT="$D" bash bench/gpu_honest.sh sweepN > "$D/sweepN.out" 2>&1
    tail -14 "$D/sweep1.out"; tail -10 "$D/sweepN.out"
    pack
    ;;
  *)
    echo "unknown stage $stage" >&2; exit 2
    ;;
esac
