#!/usr/bin/env bash
# On the GPU machine: install the carried wheels (specdec, blake3, gguf) into /tmp/site.
# Run Python with -P there, so the checkout's specdec/ folder does not shadow the installed one.
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -P -c "import specdec, specdec.kernels, blake3, gguf; print('specdec ok')"
