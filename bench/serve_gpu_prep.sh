#!/usr/bin/env bash
# CPU side of the H200 serving benchmark: writes, inside the checkout (git-ignored .stage-serve/):
#   .stage-serve/whl/           specdec as a wheel + the wheels the GPU image lacks (blake3, gguf, fastapi, uvicorn,
#                               prometheus-client, httpx and their dependencies) for Python 3.12
#   .stage-serve/prompts.jsonl  ShareGPT evaluation prompts (conversation index % 20 == 0), first user turns
#                               of at most 4,000 characters
# Run ../shared/tools/stage-model first for the model pieces (see bench/serve_gpu.sh).
#   bash bench/serve_gpu_prep.sh [NUM_PROMPTS]
set -euo pipefail
root=$(git rev-parse --show-toplevel)
n=${1:-200}
out="$root/.stage-serve"
exclude=$(git -C "$root" rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF "/.stage-serve/" "$exclude" 2>/dev/null || echo "/.stage-serve/" >> "$exclude"
rm -rf "$out" && mkdir -p "$out/whl"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$out/whl")
# blake3 and gguf without their dependencies (numpy and the rest are on the GPU image; a second numpy would shadow it)
python3 -m pip download -q --no-deps "${plat[@]}" blake3 gguf
python3 -m pip download -q "${plat[@]}" fastapi uvicorn prometheus-client httpx
python3 -m pip wheel -q --no-deps -w "$out/whl" "$root"
python3 - "$n" "$out/prompts.jsonl" <<'PY'
import json, sys
from specdec.benchmark.data import load_sharegpt
n, path = int(sys.argv[1]), sys.argv[2]
# as peers' serving benchmarks do, skip very long prompts (here: over 4,000 characters, about 1,000 tokens)
prompts = [p for p in load_sharegpt("eval", 3 * n) if len(p.messages[0]["content"]) <= 4000][:n]
with open(path, "w") as f:
    for p in prompts:
        body = {"prompt": p.prompt} if p.prompt is not None else {"messages": p.messages}
        f.write(json.dumps({"id": p.id, "category": p.category, **body}) + "\n")
print(f"{len(prompts)} ShareGPT evaluation prompts -> {path}")
PY
du -sh "$out"
