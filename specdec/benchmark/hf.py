"""transformers baselines for ``specdec bench``: plain ``generate``, static cache + torch.compile, assisted.

Three configurations, each on the same prompt ids and batch size as the engine runs:

* ``hf``: ``generate`` with the default dynamic cache, batches left-padded to their longest prompt.
* ``hf_static``: ``cache_implementation="static"`` with transformers' compiled decode forward
  (``CompileConfig``, mode ``reduce-overhead``: CUDA graphs on a GPU).  Every batch is left-padded
  to the longest prompt of the whole set, so the cache shape, and so the compiled graph, is the same
  for every call; one untimed warm-up call per distinct batch shape pays the compilation.
* ``hf_assisted``: assisted generation (prompt lookup for n-gram, else the draft as assistant
  model); transformers supports it at batch size 1 only, so it is measured only there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from specdec.benchmark.report import HF_PARTS


def to_hf_model(loaded):
    """A transformers model with the same weights as ``loaded`` (for the baselines)."""
    import transformers

    c = loaded.config
    cls_name = {"LlamaForCausalLM": "LlamaConfig", "Qwen2ForCausalLM": "Qwen2Config",
                "MistralForCausalLM": "MistralConfig"}[c.architecture]
    rope = {"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})}
    hf_cfg = getattr(transformers, cls_name)(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, rope_parameters=rope,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids) or None,
    )
    hf_cfg.architectures = [c.architecture]
    model = getattr(transformers, c.architecture)(hf_cfg)
    model.load_state_dict(loaded.model.state_dict(), strict=False)
    return model.to(device=loaded.device, dtype=loaded.dtype).eval()


def assist_skipped(draft) -> str | None:
    """Why transformers cannot use ``draft`` as its assistant (an EAGLE-style draft is no standalone model),
    else None (n-gram prompt lookup, a draft that is a whole model)."""
    from specdec.loading.roles import eagle_draft_target

    if draft != "ngram" and eagle_draft_target(draft) is not None:
        return (f"hf_assisted skipped: transformers cannot run the EAGLE-style draft {draft.name!r} as an assistant "
                "model (it reads the target's features); --draft ngram or a layer-copy draft measures it")
    return None


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def left_pad(group: Sequence[Sequence[int]], width: int, pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, width), with the prompts right-aligned."""
    if width < max(len(g) for g in group):
        raise ValueError(f"width must be >= the longest prompt ({max(len(g) for g in group)}), got {width}")
    ids = torch.tensor([[pad] * (width - len(g)) + list(g) for g in group], device=device)  # (B, W)
    mask = torch.tensor([[0] * (width - len(g)) + [1] * len(g) for g in group], device=device)  # (B, W)
    return ids, mask


def generated_lengths(new_tokens: torch.Tensor, eos: set[int]) -> list[int]:
    """Per row of ``new_tokens`` (B, N): tokens up to and including the first EOS (N if none)."""
    out = []
    for row in new_tokens.tolist():
        n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.append(n)
    return out


class HFBaselines:
    """The transformers configurations of the module docstring for one target (and draft)."""

    def __init__(self, target, draft, assist_tokens: int, params, compile_static: bool = True) -> None:
        self.model = to_hf_model(target)
        self.device = target.device
        self.eos = set(target.config.eos_token_ids)
        tok = target.tokenizer
        if tok is not None and tok.eos_token_id is not None:
            self.eos.add(tok.eos_token_id)
        self.pad = min(self.eos) if self.eos else 0
        self.compile_static = compile_static
        self.kwargs = {"max_new_tokens": params.max_new_tokens, "do_sample": not params.greedy,
                       "pad_token_id": self.pad, "eos_token_id": sorted(self.eos) or None}
        if not params.greedy:
            self.kwargs.update(temperature=params.temperature, top_p=params.top_p)
        self.draft, self.assist_tokens = draft, assist_tokens
        self.assist_skipped = assist_skipped(draft)
        self._assisted: dict | None = None
        self._warm: set[int] = set()

    def _assisted_kwargs(self) -> dict:
        """``generate``'s assisted-decoding arguments, the assistant model built on first use."""
        if self._assisted is None:
            self._assisted = ({"prompt_lookup_num_tokens": self.assist_tokens} if self.draft == "ngram"
                              else {"assistant_model": to_hf_model(self.draft)})
        return self._assisted

    def _static_kwargs(self) -> dict:
        from transformers import CompileConfig

        if not self.compile_static:
            return {"cache_implementation": "static", "disable_compile": True}
        cc = CompileConfig()
        cc._compile_all_devices = True  # transformers compiles only on accelerators unless told
        return {"cache_implementation": "static", "compile_config": cc}

    def _generate(self, x, mask, extra) -> tuple[float, list[int]]:
        _sync(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            y = self.model.generate(x, attention_mask=mask, **self.kwargs, **extra)
        _sync(self.device)
        return time.perf_counter() - t0, generated_lengths(y[:, x.shape[1]:], self.eos)

    def run(self, part: str, ids: list[list[int]], batch_size: int) -> list[dict | None]:
        """Per prompt ``{output_tokens, time_s}`` of configuration ``part`` (a batch's time split by
        output tokens); ``hf_assisted`` at a batch size other than 1 gives None per prompt."""
        if part not in HF_PARTS:
            raise ValueError(f"part must be one of {HF_PARTS}, got {part!r}")
        if part == "hf_assisted" and (batch_size != 1 or self.assist_skipped):
            return [None] * len(ids)
        from tqdm.auto import tqdm

        longest = max(len(i) for i in ids)
        extra = {"hf": dict, "hf_static": self._static_kwargs, "hf_assisted": self._assisted_kwargs}[part]()
        runs = []
        for start in tqdm(range(0, len(ids), batch_size), desc=f"transformers {part}", unit="batch"):
            group = ids[start:start + batch_size]
            width = longest if part == "hf_static" else max(len(g) for g in group)
            x, mask = left_pad(group, width, self.pad, self.device)
            if part == "hf_static" and len(group) not in self._warm:
                self._generate(x, mask, extra)  # compiles for this batch shape; not timed
                self._warm.add(len(group))
            elapsed, lengths = self._generate(x, mask, extra)
            total = sum(lengths) or 1
            runs.extend({"output_tokens": n, "time_s": elapsed * n / total} for n in lengths)
        return runs
