#!/usr/bin/env bash
# One GPU run (<= 9 minutes on one H200): train the eagle draft of SmolLM2-135M on the carried token
# file, write the shippable draft folder and measure its mean accepted length (bench/gpu_train_draft.py).
#
#   bash bench/gpu_train_draft.sh MODEL.gguf [TRAIN_SECONDS] [DEADLINE_SECONDS] [extra gpu_train_draft.py run options]
#
# Needs, in the checkout root: $WHEELS (default .whl/: the specdec wheel built from this branch, plus blake3
# and gguf from ../shared/tools/stage-model; exactly one specdec wheel) and .data/eagle/ (train.npz,
# eval_prompts.json; see the .py docstring).
# Writes under $OUT: smollm2-135m-draft/ (copy it to specdec/training/ to ship it), eagle_eval.json,
# train_draft.log. DEADLINE counts from the Python start: no evaluation starts that would end later.
set -euo pipefail
model=${1:?usage: gpu_train_draft.sh MODEL.gguf [TRAIN_SECONDS] [DEADLINE_SECONDS] [options]}
train_s=${2:-300}
deadline=${3:-490}
shift $(( $# < 3 ? $# : 3 ))
out=${OUT:-/tmp/eagle_out}
site=${SITE:-/tmp/site}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "${WHEELS:-.whl}"/*.whl
export PYTHONPATH=$site TQDM_MININTERVAL=15
python3 -P bench/gpu_train_draft.py run --model "$model" --data-dir .data/eagle --out "$out" \
  --train-seconds "$train_s" --deadline "$deadline" "$@" 2>&1 | tee "$out/train_draft.log"
