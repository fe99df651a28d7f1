"""Keyed uniforms: a request's key (from its seed) and a pure hash of (key, index), the same numbers on any device.

The engine's sampled rule (``kernels.gumbel_choice``) draws its Gumbel noise from these: per (request, position)
a sub-key of two hashed words, then per token the uniform ``uniforms_at(sub-key, token)``, so a token's noise
is a function of the seed, the position and the token alone, computed inside captured graphs with no generator
state. ``UniformStream`` holds a request's key words; its draw counter (``take``, ``padded_uniforms``) numbers
the uniforms of the counter-based reference rules (``acceptance.verify_stochastic``,
``acceptance_stochastic``), which the engine no longer calls.

The hash: three rounds of the 32-bit PCG hash (an LCG step, then PCG's RXS-M-XS output permutation; the
"pcg" hash of Jarzynski and Olano, "Hash Functions for GPU Rendering", JCGT 2020), the key's two 32-bit words
mixed in between rounds. Values stay masked to 32 bits and every multiplier is < 2**31, so int64 arithmetic
never overflows and torch (CPU or CUDA) and numpy compute the same bits. A uniform takes two 32-bit words
(53 bits, the float64 mantissa, as ``torch.rand``'s float64 has): words 2 i and 2 i + 1 of the request's
word sequence, whose index is taken modulo 2**32 (a stream repeats after 2**31 uniforms, far beyond any
request: a 64-node tree per token for 30M tokens). The key is splitmix64 of the request seed, so seeds that
differ in one bit get unrelated keys.
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


def padded_uniforms(key0: Tensor, key1: Tensor, counter: Tensor, num_tokens: Tensor, q: int) -> Tensor:
    """(B, Q) float64 uniforms of a padded step, laid out as ``verify_stochastic`` uses its draws: a row of n
    tree nodes (num_tokens = n + 1) uses draws counter .. counter + n; node c's at column c + 1, the bonus
    token's (draw n) at column 0. key0, key1, counter, num_tokens: (B,) int64. Columns past a row's tree (and
    padded rows, num_tokens 0) hold numbers nothing reads."""
    col = torch.arange(q, device=counter.device).view(1, -1)  # (1, Q)
    n = (num_tokens - 1).clamp(min=0).view(-1, 1)  # (B, 1) tree nodes
    draw = counter.view(-1, 1) + torch.where(col == 0, n, col - 1)  # (B, Q)
    return uniforms_at(key0.view(-1, 1), key1.view(-1, 1), draw)


class UniformStream:
    """A request's verification uniforms: key words of its seed and the count of draws used so far.

    ``counter`` is the whole state: fault isolation saves and restores it, and a step's device rule reads
    (key0, key1, counter) of each row and advances ``counter`` on the host by the draws it uses."""

    __slots__ = ("seed", "key0", "key1", "counter")

    def __init__(self, seed: int, counter: int = 0) -> None:
        self.seed = seed
        self.key0, self.key1 = key_words(seed)
        self.counter = counter

    def take(self, n: int) -> list[float]:
        """The next ``n`` uniforms (host floats); the counter advances by n."""
        draw = np.arange(self.counter, self.counter + n, dtype=np.int64)
        self.counter += n
        return uniforms_at(np.int64(self.key0), np.int64(self.key1), draw).tolist()

    def __repr__(self) -> str:
        return f"UniformStream(seed={self.seed}, counter={self.counter})"
