#!/usr/bin/env bash
# One GPU run (<= 9 minutes on one H200): does the eagle draft accept more when trained on replies regenerated
# by the target than on ShareGPT's own replies of the same conversations? (bench/gpu_regen_compare.py)
#
#   MODEL=/tmp/model.gguf OUT=/tmp/regen_out bash bench/gpu_regen_compare.sh [extra gpu_regen_compare.py run options]
#
# Needs: the specdec wheel of this branch (and its dependencies) installed under $SITE (default /tmp/site), and
# .data/regen/ (train.npz, eval_prompts.json) from `python bench/gpu_regen_compare.py prepare ...` (see its .py).
# Writes under $OUT: regen_compare.json, regen_compare.log (the table is printed last), and in $OUT/work/ the two
# token files and both draft folders (the training checkpoints ckpt.pt, with optimizer state, are removed).
set -euo pipefail
model=${MODEL:-/tmp/model.gguf}
out=${OUT:-/tmp/regen_out}
mkdir -p "$out"
export PYTHONPATH=${SITE:-/tmp/site} TQDM_MININTERVAL=${TQDM_MININTERVAL:-15}
python3 -P bench/gpu_regen_compare.py run --model "$model" --data-dir "${DATA:-.data/regen}" --out "$out" "$@" \
  2>&1 | tee "$out/regen_compare.log"
rm -f "$out"/work/draft-*/ckpt.pt
