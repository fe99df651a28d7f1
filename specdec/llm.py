"""``LLM``: the offline entry point of vLLM (``LLM(model=...).generate(prompts, sampling_params)`` and ``.chat``)
over ``SpecEngine``, so that code written for ``vllm.LLM`` runs with speculative decoding unchanged.

It is the same engine: ``LLM(model, draft=..., **options)`` is ``SpecEngine(draft, model, SpecConfig(**options))`` with
vLLM's option names taken as well (``VLLM_OPTIONS``) and its ``speculative_config`` read for the draft (SpecConfig
takes vLLM's ``dtype`` spellings, "half" and "float", itself)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from specdec.defaults import DEFAULT_TARGET, default_draft
from specdec.engine import SpecEngine
from specdec.outputs import RequestOutput
from specdec.prompts import is_chat
from specdec.spec_config import SpecConfig

# vLLM's engine options and the SpecConfig field each sets
VLLM_OPTIONS = {"max_num_seqs": "max_batch_size", "max_num_batched_tokens": "max_num_tokens",
                "enable_prefix_caching": "prefix_cache"}
# vLLM's engine options that have no SpecConfig field, and what to do instead
VLLM_ELSEWHERE = {"seed": "a request's seed is SamplingParams(seed=...) (each request draws its own keyed stream)",
                  "trust_remote_code": "specdec runs its own Llama-family code: no remote code is ever run",
                  "tokenizer": "the model's own tokenizer is used",
                  "max_model_len": "the model's own context length (max_position_embeddings) is used",
                  "quantization": "weights run in dtype; a .gguf file's are dequantized to it"}


class LLM(SpecEngine):
    """``LLM(model="smollm2-135m", draft="auto", **options)``: ``model`` the target (any form ``SpecEngine`` takes,
    ``model=`` as in vLLM); ``draft``, by keyword (vLLM's second positional argument is a tokenizer), the proposer
    ("auto": as the command line's, the shipped draft for the default target, n-gram lookup for any other; None:
    target-only); ``speculative_config`` as vLLM's ({"model": ..., "method": "ngram", "num_speculative_tokens": K}:
    the draft, and a chain of K tokens); ``enforce_eager=True`` captures no graphs; every other option a
    ``SpecConfig`` field or its vLLM name. An option neither knows is refused by name."""

    def __init__(self, model: Any = DEFAULT_TARGET, *, draft: Any = "auto",
                 speculative_config: dict | None = None, enforce_eager: bool | None = None, **options) -> None:
        if speculative_config is not None:
            draft, tree = _speculative(speculative_config)
            if tree is not None:
                options.setdefault("tree", tree)
        if isinstance(draft, str) and draft == "auto":
            draft = default_draft(model) if isinstance(model, str) else "ngram"
        if enforce_eager is not None:
            options["cuda_graphs"] = not enforce_eager
        super().__init__(draft, model, SpecConfig(**_spec_options(options)))

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """``SpecEngine.generate`` under vLLM's argument name: one output per prompt, in order."""
        return super().generate(prompts, sampling_params, use_tqdm)

    def get_tokenizer(self):
        """The target's tokenizer (a transformers tokenizer; None for a model without one), as vLLM's
        ``LLM.get_tokenizer``: what renders ``chat`` prompts and decodes outputs."""
        return self.target.tokenizer

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or a list of them, each rendered with the
        target's chat template: one output per conversation."""
        if not messages or not (is_chat(messages) or all(is_chat(m) for m in messages)):
            raise TypeError("messages must be a conversation (a list of {'role': ..., 'content': ...} dicts) or a "
                            "list of conversations")
        return super().generate(messages, sampling_params, use_tqdm)


def _spec_options(options: dict) -> dict:
    """``options`` as SpecConfig fields (vLLM's names renamed); TypeError naming an option neither knows (with the
    fields it could have meant)."""
    known = {f.name for f in fields(SpecConfig)}
    out, given = {}, {}
    for name, value in options.items():
        field = VLLM_OPTIONS.get(name, name)
        if name in VLLM_ELSEWHERE:
            raise TypeError(f"LLM has no option {name!r}: {VLLM_ELSEWHERE[name]}")
        if field not in known:
            raise TypeError(f"LLM got an unknown option {name!r}: give a SpecConfig field ({', '.join(sorted(known))}) "
                            f"or one of vLLM's names it maps ({', '.join(sorted(VLLM_OPTIONS))})")
        if field in out:
            raise TypeError(f"LLM got {field!r} twice: as {given[field]!r} and as {name!r}")
        out[field], given[field] = value, name
    return out


def _speculative(cfg: dict) -> tuple[Any, str | None]:
    """The draft and the tree (None: the default) of vLLM's ``speculative_config``."""
    unknown = set(cfg) - {"model", "method", "num_speculative_tokens"}
    if unknown:
        raise TypeError(f"speculative_config: unknown key(s) {sorted(unknown)}; give 'model', 'method' "
                        f"('ngram' or a draft model's) and 'num_speculative_tokens'")
    method, model, k = cfg.get("method"), cfg.get("model"), cfg.get("num_speculative_tokens")
    draft = "ngram" if method == "ngram" else model
    if draft is None:
        raise TypeError("speculative_config needs 'model' (a draft model) or 'method': 'ngram'")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise TypeError(f"speculative_config: num_speculative_tokens must be an int >= 1, got {k!r}")
    return draft, None if k is None else f"chain:{k}"
