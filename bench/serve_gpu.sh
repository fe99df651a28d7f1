#!/usr/bin/env bash
# H200 serving benchmark in one run: for target-only and speculative decoding, start `specdec serve` in the
# background, run `specdec bench-serve` on ShareGPT evaluation prompts at three request rates, stop it.
# Writes $OUT/serve_<config>.log (server), $OUT/bench_<config>_rate<R>.{json,log}, $OUT/summary.json/.md.
#
# Prepare on the CPU (inside the checkout; both folders are git-ignored):
#   ../shared/tools/stage-model && bash bench/serve_gpu_prep.sh 200
# GPU run 1 (carry .stage/piece_00):  mkdir -p /tmp/stage && cp .stage/piece_00/* /tmp/stage/
# GPU run 2 (carry .stage/piece_01 and .stage-serve):
#   cp .stage/piece_01/* /tmp/stage/ && cat /tmp/stage/piece.* > /tmp/model.gguf && bash bench/serve_gpu.sh
#
# Settings (environment): MODEL (/tmp/model.gguf), RATES ("2 8 32"), NUM_PROMPTS (100), MAX_TOKENS (128),
# CONCURRENCY (64), SPEC_DRAFT (ngram), SPEC_TREE (chain:4), DEVICE_ARGS (""), BUDGET_S (560: stop early
# so that what was measured comes back within one 10-minute run), NO_WHEELS (set: use what is installed).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$root/out}
MODEL=${MODEL:-/tmp/model.gguf}
RATES=${RATES:-"2 8 32"}
NUM_PROMPTS=${NUM_PROMPTS:-100}
MAX_TOKENS=${MAX_TOKENS:-128}
CONCURRENCY=${CONCURRENCY:-64}
SPEC_DRAFT=${SPEC_DRAFT:-ngram}
SPEC_TREE=${SPEC_TREE:-chain:4}
DEVICE_ARGS=${DEVICE_ARGS:-}
BUDGET_S=${BUDGET_S:-560}
PROMPTS=${PROMPTS:-$root/.stage-serve/prompts.jsonl}
PORT=${PORT:-8765}
start=$(date +%s)
mkdir -p "$OUT"

if [ -d "$root/.stage-serve/whl" ] && [ -z "${NO_WHEELS:-}" ]; then  # the wheels the image lacks, and specdec
  python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site "$root"/.stage-serve/whl/*.whl \
    > "$OUT/pip.log" 2>&1 || { echo "wheel install failed, see pip.log"; tail -5 "$OUT/pip.log"; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
cd /tmp  # run the installed package, not the checkout's folders (python -P as well)
py() { python3 -P "$@"; }
py -c "import torch, specdec; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/env.txt" 2>/dev/null || true

get() { python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())" "http://127.0.0.1:$PORT$1"; }
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }

run_config() {  # name draft tree
  local name=$1 draft=$2 tree=$3 pid
  PORT=$((PORT + 1))  # a fresh port per server: a health check never reaches the previous one
  python3 -P -m specdec.cli serve --target "$MODEL" --draft "$draft" --tree "$tree" --port "$PORT" \
     --served-model-name smollm2-135m --log-level warning $DEVICE_ARGS > "$OUT/serve_$name.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 480); do  # up to 4 minutes: model load, tokenizer conversion, CUDA graph capture
    get "/health" > /dev/null 2>&1 && break
    kill -0 $pid 2>/dev/null || { echo "server $name died"; tail -20 "$OUT/serve_$name.log"; return 1; }
    sleep 0.5
  done
  # warm-up (first CUDA work, allocator), not measured
  py -m specdec.cli bench-serve --url "http://127.0.0.1:$PORT" --dataset "$PROMPTS" --num-prompts 8 \
     --max-tokens 16 --label warmup > "$OUT/warmup_$name.log" 2>&1
  for rate in $RATES; do
    if [ "$(left)" -lt 40 ]; then echo "budget spent: skipping $name rate $rate"; continue; fi
    timeout "$(left)" python3 -P -m specdec.cli bench-serve --url "http://127.0.0.1:$PORT" --dataset "$PROMPTS" \
      --num-prompts "$NUM_PROMPTS" --request-rate "$rate" --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" \
      --label "${name}_rate$rate" --json "$OUT/bench_${name}_rate$rate.json" 2>&1 | tee "$OUT/bench_${name}_rate$rate.log"
    get "/metrics" > "$OUT/metrics_${name}_rate$rate.txt"
  done
  kill "$pid"; wait "$pid" 2>/dev/null
}

run_config target_only none chain:4
run_config spec "$SPEC_DRAFT" "$SPEC_TREE"

py - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = [json.load(open(p)) for p in glob.glob(os.path.join(out, "bench_*_rate*.json"))]
rows.sort(key=lambda r: (r["label"].rsplit("_rate", 1)[0] != "target_only", r["config"]["request_rate"]))
json.dump(rows, open(os.path.join(out, "summary.json"), "w"), indent=2)
lines = ["| config | rate (req/s) | completed | req/s | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
         "| e2e p50 / p99 (ms) | mean accepted length |", "|" + "---|" * 9]
for r in rows:
    f = lambda k: f"{r[k]['p50_ms']:.0f} / {r[k]['p99_ms']:.0f}" if r[k]["p50_ms"] is not None else "-"
    lines.append(f"| {r['label'].rsplit('_rate', 1)[0]} | {r['config']['request_rate']} | {r['completed']}/"
                 f"{r['completed'] + r['failed']} | {r['request_throughput']:.2f} | {r['output_throughput']:.0f} | "
                 f"{f('ttft')} | {f('tpot')} | {f('e2e_latency')} | {r['mean_accepted_length'] or 0:.2f} |")
by = {(r["label"].rsplit("_rate", 1)[0], r["config"]["request_rate"]): r for r in rows}
lines += ["", "| rate (req/s) | spec / target-only output tok/s | TPOT p50 ratio | TTFT p50 ratio |", "|---|---|---|---|"]
for (name, rate), s in by.items():
    t = by.get(("target_only", rate))
    if name == "spec" and t and t["output_throughput"] and t["tpot"]["p50_ms"] and t["ttft"]["p50_ms"]:
        lines.append(f"| {rate} | {s['output_throughput'] / t['output_throughput']:.2f}x | "
                     f"{s['tpot']['p50_ms'] / t['tpot']['p50_ms']:.2f} | {s['ttft']['p50_ms'] / t['ttft']['p50_ms']:.2f} |")
open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
