"""specdec: lossless speculative decoding on one shared paged KV pool."""

from specdec.engine import SpecConfig, SpecEngine
from specdec.llm import LLM
from specdec.loading.registry import LoadedModel, load_model, truncate_layers
from specdec.outputs import AcceptanceStats, RequestOutput
from specdec.sampling_params import SamplingParams

__all__ = ["SpecEngine", "LLM", "SpecConfig", "SamplingParams", "RequestOutput", "AcceptanceStats", "load_model",
           "LoadedModel", "truncate_layers"]
