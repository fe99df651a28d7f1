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
#   any run after 3 (.whl .gpu)        bash bench/gpu_session.sh chisq     (sampling losslessness, 20k samples)
#   any run after 3 (.whl .gpu)        bash bench/gpu_session.sh lp_read   (log-probabilities' read, variants)
#   any run after 3 (.whl)             bash bench/gpu_session.sh train_profile (a draft training step by phase)
#   any run (.whl)                     bash bench/gpu_session.sh kernels   (launch settings of the sampling kernels)
#   after 3, on several GPUs (.whl .gpu) bash bench/gpu_session.sh dp      (data-parallel serving against one GPU)
#   any run (.data/distill/parts/...)  bash bench/gpu_session.sh parts     (training files split to fit a run: joined
#                                      by the distill round; a piece's run takes one such part too)
# Training a draft (bench/README.md, "Training the default draft"): run 1 also carries .data/distill/regen.npz (the
# target's replies; else .data/distill/prompts.npz from `bash bench/gpu_session.sh distill_prep`, regenerated in
# `distill 1`), then `distill 1` and `distill 2` in two runs; INIT_FROM (default smollm2-135m-draft) is warm-started.
# Rounds: tests (the GPU tests of the step), plan NAME TEMPERATURE (ENGINES, default the CUDA defaults, cold and
# interleaved at batch 1, 16 and 64, or BATCHES), suites (the pytest-benchmark suites of bench/, compared with
# bench/baselines), profile (bench/gpu_profile.py: wall time against kernel time per step).
# Each round packs its logs and JSON into $OUT/<round>.tgz (the device tool returns at most 8 files) and prints
# a short summary last.
set -uo pipefail
stage=${1:?usage: gpu_session.sh prep | distill_prep | piece NN | parts | tests | plan NAME TEMPERATURE | suites | profile | lp_read | train_profile | chisq | kernels | dp | distill 1|2}
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-/tmp/model.gguf}
root=$(pwd)
D="$OUT/$stage${2:+_$2}"

prep() {  # on the CPU machine: the model's pieces, the wheels and the prompt file (ignored by git); PYTHON: a Python
          # with specdec and its test extras installed (default python3)
  local py=${PYTHON:-python3} src tmp
  src=$("$py" -P -c "from specdec.loading.gguf_loader import smollm2_gguf_path; print(smollm2_gguf_path())") || return 1
  rm -rf build .whl .stage3 && mkdir -p .whl .gpu
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl blake3==1.0.11 gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 opentelemetry-api==1.45.3 uvicorn==0.55.0 \
    openai==3.63.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 \
    h11==0.16.0 || return 1  # the GPU image lacks them (Python 3.12 there): the server's and the openai client's, for
    # the dp round and tests/test_serving_data_parallel.py; pinned to the set the GPU tests passed with (session 42):
    # newer releases twice needed packages the image lacks
  "$py" -m pip wheel -q --no-deps -w .whl . && rm -rf build || return 1
  git describe --always --dirty > .whl/commit.txt
  tmp=$(mktemp -d) && split -b 35000000 -d "$src" "$tmp/piece."
  for p in "$tmp"/piece.*; do mkdir -p ".stage3/p_${p##*.}" && mv "$p" ".stage3/p_${p##*.}/"; done
  rmdir "$tmp"
  "$py" -P bench/gpu_interleaved.py --prompts .gpu/mtbench_ids.json
  "$py" -P -c "import json, sys; from specdec.benchmark.data import load_dataset
for p in load_dataset('sharegpt', 200): print(json.dumps({'id': p.id, 'messages': p.to_messages()}))
" > .gpu/sharegpt200.jsonl || return 1  # (the dp round's requests: bench-serve reads them on the GPU machine)
  ls -la .stage3/* .whl
}

distill_prep() {  # on the CPU machine: the ShareGPT train split's prompts for regenerating replies (user turns, each
                 # reply cut to its closing tokens, DISTILL_TURNS turns), ~10 MB, into .data/distill/prompts.npz
  local py=${PYTHON:-python3}
  mkdir -p .data/distill
  "$py" -P -m specdec.cli distill --kind eagle --write-tokens .data/distill/prompts.npz --prompts-only \
    --max-turns "${DISTILL_TURNS:-3}" --max-len 4096 --num-tokens 1000000000 || return 1
  ls -la .data/distill
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
  cat /tmp/stage/piece.* > "$MODEL.part" && mv "$MODEL.part" "$MODEL" && md5sum "$MODEL" | tee "$D/md5.txt"
}

script_round() {  # script_round SECONDS SCRIPT LOG PATTERN LINES [ARG...]: bench/SCRIPT over the model (assembled
                 # first if need be) and the prompt file, its output in $D/LOG; prints its exit status and the last
                 # LINES lines of LOG that match PATTERN, then packs the round
  local limit=$1 script=$2 log=$3 pattern=$4 lines=$5
  shift 5
  [ -s "$MODEL" ] || assemble
  install
  (cd /tmp && timeout "$limit" python3 -P "$root/bench/$script" "$D" "$MODEL" "$root/.gpu/mtbench_ids.json" "$@" \
    > "$D/$log" 2>&1)
  echo "$stage exit $?"; grep -h "$pattern" "$D/$log" | tail -"$lines"
  pack
}

gpu_tests() {  # gpu_tests SECONDS FILE...: the GPU test files into $D/tests.log (GPU_K: a -k filter)
  local limit=$1; shift
  SPECDEC_TESTS_WITHOUT_SMOLLM2=1 timeout "$limit" python3 -P -m pytest -v -p no:cacheprovider "$@" ${GPU_TESTS:-} ${GPU_K:+-k "$GPU_K"} > "$D/tests.log" 2>&1
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
      1) COLD=1 ENGINES=$ENGINES TEMPERATURE=$t NUM_PROMPTS=24 REPEATS_B1=3 interleaved "${PLAN_LIMIT:-150}" 1 ;;
      16) COLD=1 ENGINES=$ENGINES TEMPERATURE=$t SCHEDULES=continuous REPEATS=5 interleaved "${PLAN_LIMIT:-150}" 16 ;;
      64) COLD=1 ENGINES=$ENGINES TEMPERATURE=$t SCHEDULES=continuous REPEATS=5 PROMPT_SET=sharegpt interleaved "${PLAN_LIMIT:-150}" 64 ;;
    esac
    keep_interleaved "${name}_b$b.log" "${name}_b$b.json"
  done
}

carried_parts() {  # what a run carried of .data/distill: whole .npz files, and parts (regen.npz.partNN, ckpt.pt.partNN:
                  # files split to fit the 64 MiB a run carries) that distill_round joins once all have come
  local work=${DISTILL_WORK:-/tmp/distill}  # (where distill_round looks for them)
  [ -d "$root/.data/distill" ] || return 0
  mkdir -p "$work"
  cp "$root"/.data/distill/*.npz "$work/" 2>/dev/null
  cp "$root"/.data/distill/parts/* "$work/" 2>/dev/null
  ls "$work"
}

join_parts() {  # join_parts NAME DEST: /tmp/distill/NAME.partNN into DEST, unless DEST is there
  local work=${DISTILL_WORK:-/tmp/distill}
  [ -f "$2" ] || ! ls "$work/$1".part* > /dev/null 2>&1 || { mkdir -p "$(dirname "$2")" && cat "$work/$1".part* > "$2" \
    && echo "joined $(ls "$work/$1".part* | wc -l) parts into $2 ($(md5sum < "$2" | cut -c1-32))"; }
}

distill_round() {  # distill 1 | distill 2: regenerate and train (1), train on and measure (2); see bench/README.md
  local part=$1 work=${DISTILL_WORK:-/tmp/distill} init=${INIT_FROM-smollm2-135m-draft} left
  local sd=(python3 -P -m specdec.cli distill --kind eagle --target "$MODEL" --device "${DEVICE:-cuda}")
  mkdir -p "$work"
  export TQDM_MININTERVAL=${TQDM_MININTERVAL:-20} PYTHONUNBUFFERED=1
  # the regenerated replies: regen.npz (from prompt conversation 0), and regen_K.npz of a later session that went on
  # from conversation K (REGEN_START=K); training reads every regen*.npz there, in name order
  local regen="$work/regen${REGEN_START:+_$REGEN_START}.npz" tokens p n
  [ -f "$work/regen.npz" ] || [ ! -f "$root/.data/distill/regen.npz" ] || cp "$root/.data/distill/regen.npz" "$work/"
  for p in "$work"/regen*.npz.part00; do [ -e "$p" ] || continue; n=${p##*/}; join_parts "${n%.part00}" "$work/${n%.part00}"; done
  join_parts ckpt.pt "$work/draft/ckpt.pt"  # a checkpoint of an earlier session's round: --resume goes on exactly
  if [ "$part" = 1 ] && [ ! -f "$regen" ]; then
    local prompts=${DISTILL_PROMPTS:-$root/.data/distill/prompts.npz}
    [ -f "$prompts" ] || prompts="$work/prompts.npz"
    timeout "${REGEN_LIMIT:-330}" "${sd[@]}" --regenerate "$prompts" --write-tokens "$regen" --max-len 1024 \
      --max-turns "${DISTILL_TURNS:-3}" --regen-temperatures "${REGEN_TEMPERATURES:-0,0.7}" \
      --regen-new-tokens "${REGEN_NEW_TOKENS:-256}" --regen-seconds "${REGEN_SECONDS:-270}" \
      --regen-batch "${REGEN_BATCH:-256}" ${REGEN_START:+--regen-start "$REGEN_START"} > "$D/regen.log" 2>&1
    echo "regen exit $?"; grep "^distill" "$D/regen.log"
    [ -f "$regen" ] && split -b 15000000 -d "$regen" "$OUT/${regen##*/}.part"  # kept if the machine goes
  fi
  tokens=$(ls "$work"/regen*.npz 2> /dev/null | sort | paste -sd, -)
  [ -n "$tokens" ] || { echo "no $work/regen*.npz: run distill 1 first"; return 1; }
  echo "regen: training on $tokens ($(du -cm "$work"/regen*.npz | tail -1 | cut -f1) MB)"
  # this run's training seconds: what is left of DISTILL_LIMIT after loading (~40 s) and, in part 2, the measurement
  left=$(( ${DISTILL_LIMIT:-560} - SECONDS - 40 - (part == 2 ? ${MEASURE_RESERVE:-200} : 0) ))
  [ "$left" -gt 10 ] || { echo "only ${left}s left for training; run distill $part again"; return 1; }
  echo "train: from ${init:-a fresh draft}, peak lr ${LR:-the default}, ${left}s of TRAIN_SECONDS ${TRAIN_SECONDS:-480}"
  timeout $(( left + 120 )) "${sd[@]}" --dtype "${DTYPE:-bfloat16}" --tokens "$tokens" --out "$work/draft" \
    --target-name "${TARGET_NAME:-smollm2-135m}" --resume --run-seconds "$left" --time-budget "${TRAIN_SECONDS:-480}" \
    --steps 1000000 --warmup-steps 100 --unroll "${UNROLL:-6}" --step-decay "${STEP_DECAY:-0.8}" \
    --sampled-weight "${SAMPLED_WEIGHT:-0.5}" --loss-temperature 0.7 --batch-tokens "${BATCH_TOKENS:-32768}" \
    --max-len 1024 --val-docs 64 --ckpt-every 500 ${init:+--init-from "$init"} ${LR:+--lr "$LR"} \
    ${DRAFT_VOCAB:+--draft-vocab "$DRAFT_VOCAB"} > "$D/train_$part.log" 2>&1
  echo "train exit $?"; grep "^distill" "$D/train_$part.log"
  # the checkpoint comes back in parts (.data/distill/parts/ for a later session), in case the machine goes
  # (16 MB parts); not once training has finished (the draft is written), and not when with this run's parts of
  # regen.npz they would pass what a run returns (RETURN_MB, 60): the replies serve every later session, the
  # checkpoint only this one's next run, which finds it on the machine while it stays up
  local returned ckpt_size
  returned=$(cat "$OUT"/*.part* 2>/dev/null | wc -c)
  ckpt_size=$(stat -c %s "$work/draft/ckpt.pt" 2>/dev/null || echo 0)
  [ ! -f "$work/draft/ckpt.pt" ] || [ -f "$work/draft/model.safetensors" ] \
    || [ $(( returned + ckpt_size )) -gt $(( ${RETURN_MB:-60} * 1000000 )) ] \
    || split -b 16000000 -d "$work/draft/ckpt.pt" "$OUT/ckpt.pt.part"
  [ ! -f "$work/draft/model.safetensors" ] \
    || { mkdir -p "$D/draft" && cp "$work/draft/model.safetensors" "$work/draft/specdec_draft.json" "$D/draft/"; }
  [ "$part" = 2 ] || return 0
  [ -f "$work/draft/model.safetensors" ] || { echo "training not finished: run distill 2 again"; return 1; }
  timeout "${MEASURE_LIMIT:-300}" "${sd[@]}" --measure "${MEASURE_SETS:-$root/.gpu/mtbench_ids.json}" \
    --out "$work/draft" ${COMPARE:+--compare "$COMPARE"} --tree "${TREES:-dynamic:31,dynamic:31:6x8}" \
    --measure-new-tokens "${MEASURE_NEW_TOKENS:-128}" --json "$D/measure.json" > "$D/measure.log" 2>&1
  echo "measure exit $?"; grep "^measure" "$D/measure.log"
  mkdir -p "$D/draft" && cp "$work/draft/model.safetensors" "$work/draft/specdec_draft.json" "$D/draft/"
}

suites() {  # the pytest-benchmark suites, compared with the committed baseline of this machine kind when there is one
            # (BENCH_K: a -k filter of the entries). The storage lies under the checkout: pytest-benchmark names it
            # relative to the working directory when it warns that the baseline's machine differs (an H100 run
            # against the H200's baseline), and a storage outside it crashed the session there
  local store="$root/.gpu_out/baselines" compare=()
  rm -rf "$store" && mkdir -p "$store" && cp -r "$root"/bench/baselines/. "$store/" 2>/dev/null
  ls "$store"/Linux-CPython-3.12-64bit/*.json > /dev/null 2>&1 && compare=(--benchmark-compare)
  (cd "$root" && BENCH_MODEL=$MODEL timeout "${SUITES_LIMIT:-500}" python3 -P -m pytest -p no:cacheprovider \
    bench/bench_steps.py bench/bench_kernels.py bench/bench_decode.py bench/bench_train.py ${BENCH_K:+-k "$BENCH_K"} \
    --benchmark-storage="file://$store" --benchmark-save=h200 "${compare[@]}" \
    --benchmark-columns=median,iqr,rounds > "$D/suites.log" 2>&1)
  echo "suites exit $?"; tail -n 45 "$D/suites.log"
  cp -r "$store" "$D/baselines"
}

[ "$stage" = prep ] && { prep; exit; }
[ "$stage" = distill_prep ] && { distill_prep; exit; }
mkdir -p "$D"
dp_rounds() {  # the dp round: output tokens/s of DP_SIZE replicas against one, bench-serve's JSON per run
  local n=${DP_SIZE:-2} port=8417 r dp pid ok
  for r in $(seq 1 "${DP_ROUNDS:-3}"); do
    for dp in 1 "$n"; do
      python3 -P -m specdec.cli serve --model "$MODEL" --port "$port" --data-parallel-size "$dp" --max-batch-size 64 \
        ${DP_SERVE_ARGS:-} \
        > "$D/serve_dp${dp}_r$r.log" 2>&1 &
      pid=$! ok=
      for _ in $(seq 1 300); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
          2> /dev/null && ok=1 && break
        kill -0 "$pid" 2> /dev/null || break
        sleep 1
      done
      if [ -n "$ok" ]; then
        timeout "${DP_LIMIT:-300}" python3 -P -m specdec.cli bench-serve --url "http://127.0.0.1:$port" \
          --dataset-path "$root/.gpu/sharegpt200.jsonl" --num-prompts "${DP_PROMPTS:-200}" \
          --max-concurrency $((64 * dp)) --max-tokens "${DP_TOKENS:-128}" --ignore-eos --label "dp${dp}_r$r" --json "$D/dp${dp}_r$r.json" \
          > "$D/bench_dp${dp}_r$r.log" 2>&1
        echo "dp $dp round $r: $(grep -i "output.*tok/s\|throughput" "$D/bench_dp${dp}_r$r.log" | head -2 | tr '\n' ' ')"
      else
        echo "dp $dp round $r: the server did not come up"; tail -5 "$D/serve_dp${dp}_r$r.log"
      fi
      kill -INT "$pid" 2> /dev/null; wait "$pid" 2> /dev/null
    done
  done
}

case "$stage" in
  piece)
    mkdir -p /tmp/stage && cp "$root"/.stage3/p_"$2"/* /tmp/stage/ && ls -la /tmp/stage
    carried_parts
    rm -rf "${OUT:?}/$stage"
    ;;
  parts)  # (.data/distill/parts/<some>) only the carried training files, for those that do not fit a piece's run
    carried_parts
    rm -rf "${OUT:?}/$stage"
    ;;
  tests)  # (.whl, the model assembled, or .stage3/p_02 with piece 02) the GPU tests of the step: graphs, EAGLE, the
          # sampled rule and its kernels (token choice, top-k/top-p filter), fused and pipelined steps at every
          # budget, n-gram on the device, the warm-up (GPU_K: the -k filter, "gpu or cuda" unless set; "" runs all)
    [ -s "$MODEL" ] || assemble
    install
    # shellcheck disable=SC2086 # (TEST_FILES: a space-separated subset of the files)
    GPU_K="${GPU_K-gpu or cuda}" gpu_tests "${TESTS_LIMIT:-400}" ${TEST_FILES:-tests/test_step_graphs.py tests/test_eagle.py \
      tests/test_sampled_rule.py tests/test_fused_step.py tests/test_lookahead.py tests/test_ngram_device.py \
      tests/test_warm_up.py tests/test_pipelined_budgets.py tests/test_kernels_gumbel_choice.py \
      tests/test_kernels_nucleus.py tests/test_kernels_topk.py tests/test_kernels_advance.py \
      tests/test_kernels_kv_movement.py tests/test_eagle_budget_levels.py tests/test_mixed_batch_identity.py \
      tests/test_eagle_features.py tests/test_pipeline_churn.py tests/test_kernels_kl_rows.py tests/test_kernels_tree_write.py \
      tests/test_tensor_parallel_gpu.py tests/test_serving_data_parallel.py tests/test_logprobs.py}
    pack
    ;;
  plan)  # plan NAME TEMPERATURE (.whl .gpu, the model assembled or .stage3/p_02): ENGINES (default plan) cold and
         # interleaved at batch 1 (24 MT-bench), 16 (80 MT-bench) and 64 (200 ShareGPT-eval), continuous batching;
         # BATCHES: a subset of "1 16 64"
    [ -s "$MODEL" ] || assemble
    install
    plan_rounds "${2:?plan NAME TEMPERATURE}" "${3:?plan NAME TEMPERATURE}"
    pack
    ;;
  profile)  # (.whl .gpu, the model assembled or .stage3/p_02 with piece 02) bench/gpu_profile.py: wall time per step
             # against kernel time per step, per configuration (ONLY: a subset)
    script_round "${PROFILE_LIMIT:-420}" gpu_profile.py profile.log "^profile\|Error\|error" 30
    ;;
  lp_read)  # (.whl .gpu, the model assembled or .stage3/p_02 with piece 02) bench/gpu_logprobs_read.py: what reading
            # log-probabilities costs a pipelined target-only step, by how the read is made
    script_round "${LP_READ_LIMIT:-200}" gpu_logprobs_read.py logprobs_read.log "^logprobs_read b[0-9]*:\|Error" 4
    ;;
  chisq)  # (.whl .gpu, the model assembled or .stage3/p_02 with piece 02) bench/gpu_chisq.py: the first two sampled
          # tokens of CHISQ_SAMPLES (20000) seeded requests with the shipped draft through the CUDA defaults, float32,
          # chi-square against the exact target distribution at T=0.7/1.0 top-p 0.9 and T=1.0, and the negative control
          # (CHISQ_CONTROL_ONLY=1: the control alone)
    script_round "${CHISQ_LIMIT:-540}" gpu_chisq.py chisq.log "^chisq\|Error\|error" 10 \
      --samples "${CHISQ_SAMPLES:-20000}" ${CHISQ_CONTROL_ONLY:+--control-only}
    ;;
  train_profile)  # (.whl, the model assembled or .stage3/p_02 with piece 02) bench/gpu_train_profile.py: a draft
                  # training step's time by phase and its top operators (TRAIN_STEPS timed steps, default 10)
    [ -s "$MODEL" ] || assemble
    install
    (cd /tmp && timeout "${TRAIN_PROFILE_LIMIT:-150}" python3 -P "$root/bench/gpu_train_profile.py" "$D" "$MODEL" \
      "${TRAIN_STEPS:-10}" > "$D/train_profile.log" 2>&1)
    echo "train_profile exit $?"; tail -3 "$D/train_profile.log"
    pack
    ;;
  kernels)  # (.whl) bench/gpu_sampling_kernels.py: block and warps of the sampled rule's filter and token choice
    install
    (cd /tmp && timeout "${KERNELS_LIMIT:-240}" python3 -P "$root/bench/gpu_sampling_kernels.py" "$D" \
      > "$D/kernels.log" 2>&1)
    echo "kernels exit $?"; grep -h "^kernels\|Error" "$D/kernels.log" | tail -14
    pack
    ;;
  suites)  # (.whl, the model assembled on this machine) bench_steps, bench_kernels, bench_decode
    [ -s "$MODEL" ] || assemble
    install
    suites
    pack
    ;;
  distill)  # distill 1 | distill 2 (.whl .gpu; the model assembled or .stage3/p_02; .data/distill/regen.npz or
            # prompts.npz carried in an earlier run): 1 regenerates replies (REGEN_SECONDS) unless regen.npz came, and
            # trains (what is left of DISTILL_LIMIT), 2 trains on to TRAIN_SECONDS in all and measures the draft
            # against COMPARE (bench/README.md lists the variables)
    [ -e "$MODEL" ] || assemble
    [ -n "${NO_INSTALL:-}" ] || install
    COMPARE=${COMPARE-smollm2-135m-draft} distill_round "${2:?distill 1|2}"
    pack
    ;;
  dp)  # (.whl .gpu, the model assembled or .stage3/p_02 with piece 02; several GPUs) `specdec serve` with 1 and with
       # DP_SIZE (default 2) replicas of batch 64, in turn for DP_ROUNDS rounds (default 3), each loaded by `specdec
       # bench-serve` with the 200 ShareGPT-eval requests, 64 in flight per replica, 128 tokens, EOS ignored
    [ -s "$MODEL" ] || assemble
    install
    dp_rounds
    pack
    ;;
  *)
    echo "unknown stage $stage" >&2; exit 2
    ;;
esac
