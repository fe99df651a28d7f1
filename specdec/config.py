"""Frozen configuration dataclasses, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the dtypes a model runs and stores in (loading.base.DTYPES)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one Llama-family decoder, independent of where weights came from."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Build from a transformers ``PretrainedConfig`` (Llama, Qwen2 or Mistral)."""
        archs = getattr(hf_config, "architectures", None) or []
        model_type = getattr(hf_config, "model_type", "llama")
        default_arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                        "mistral": "MistralForCausalLM"}.get(model_type, str(model_type))
        arch = archs[0] if archs else default_arch
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        rope_scaling = getattr(hf_config, "rope_scaling", None)
        rope_params = getattr(hf_config, "rope_parameters", None)
        theta = getattr(hf_config, "rope_theta", None)
        if isinstance(rope_params, dict):
            theta = rope_params.get("rope_theta", theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        sliding = getattr(hf_config, "sliding_window", None) if model_type == "mistral" else None
        if model_type == "qwen2" and getattr(hf_config, "use_sliding_window", False):
            sliding = hf_config.sliding_window
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf_config, "attention_bias", model_type == "qwen2")),
            sliding_window=sliding,
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )
