"""Keyed uniforms: a request's key (from its seed) and a pure hash of (key, index), the same numbers on any device.

The engine's sampled rule (``kernels.gumbel_noise``) draws its Gumbel noise from these: per (request, position)
a sub-key of two hashed words, then per token the uniform ``uniforms_at(sub-key, token)``, so a token's noise
is a function of the seed, the position and the token alone, computed inside captured graphs with no generator
state. ``UniformStream`` holds a request's key words.

The hash: three rounds of the 32-bit PCG hash (an LCG step, then PCG's RXS-M-XS output permutation; the
"pcg" hash of Jarzynski and Olano, "Hash Functions for GPU Rendering", JCGT 2020), the key's two 32-bit words
mixed in between rounds. Values stay masked to 32 bits and every multiplier is < 2**31, so int64 arithmetic
never overflows and torch (CPU or CUDA) and numpy compute the same bits. A uniform takes two 32-bit words
(53 bits, the float64 mantissa, as ``torch.rand``'s float64 has): draw i is words 2 i and 2 i + 1 of the key's
word sequence, whose index is taken modulo 2**32 (a key's draws repeat after 2**31). The key is splitmix64 of
the request seed, so seeds that differ in one bit get unrelated keys.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
_MUL, _INC, _OUT = 747796405, 2891336453, 277803737  # PCG's 32-bit LCG multiplier/increment, RXS-M-XS multiplier
_MASK64 = 2**64 - 1


def key_words(seed: int) -> tuple[int, int]:
    """The two 32-bit key words of a request seed (any int; taken modulo 2**64): splitmix64's finalizer."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & MASK32, z >> 32


def _pcg(v):
    """One round of the PCG hash on an int64 numpy array or tensor of values in [0, 2**32)."""
    state = (v * _MUL + _INC) & MASK32
    word = (((state >> ((state >> 28) + 4)) ^ state) * _OUT) & MASK32
    return (word >> 22) ^ word


def hash_words(key0, key1, index):
    """32-bit words (int64 in [0, 2**32)) of key (key0, key1) at word indices ``index`` (broadcast together;
    numpy arrays or tensors, int64)."""
    return _pcg(_pcg(_pcg(index & MASK32) ^ key0) ^ key1)


def uniforms_at(key0, key1, draw):
    """Float64 uniforms in [0, 1) of draws ``draw`` (int64 >= 0, an array or tensor) of key (key0, key1), numpy or
    torch alike. Both words of a draw go through one ``hash_words`` call: inside the captured rule every op of
    the hash is a kernel, so hashing them separately cost twice the launches."""
    torch_in = isinstance(draw, Tensor)
    pair = torch.arange(2, device=draw.device) if torch_in else np.arange(2, dtype=np.int64)  # (2,) word of a draw
    words = hash_words(_word_axis(key0), _word_axis(key1), 2 * draw[..., None] + pair)  # (..., 2): one hash for both
    bits = (words[..., 0] << 21) | (words[..., 1] >> 11)  # 53 random bits, exact in float64
    scale = 2.0 ** -53
    if torch_in:
        return bits.to(torch.float64) * scale
    return bits.astype(np.float64) * scale


def _word_axis(key):
    """A key word (int, 0-d, or an array broadcast against the draws) with a trailing axis for the word pair."""
    return key[..., None] if getattr(key, "ndim", 0) else key


class UniformStream:
    """A sampled request's noise key: the two key words of its seed (``kernels.gumbel_noise`` hashes them with
    each position and token); a request keeps one for its whole life."""

    __slots__ = ("seed", "key0", "key1")

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.key0, self.key1 = key_words(seed)

    def __repr__(self) -> str:
        return f"UniformStream(seed={self.seed})"
