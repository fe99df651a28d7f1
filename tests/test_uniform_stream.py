"""The keyed uniforms under the sampled rule's noise (``specdec.uniform_stream``): values against a plain-Python
reference, the same numbers from numpy and torch, uniformity and independence by chi-square (sample counts
stated next to each test, P_MIN as the other chi-square tests). The CUDA test compares the GPU's numbers with
the CPU's bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.uniform_stream import UniformStream, key_words, uniforms_at

scipy_stats = pytest.importorskip("scipy.stats")

P_MIN = 1e-3
U32 = 2**32


def _ref_pcg(v: int) -> int:
    """PCG hash of one 32-bit value, in unbounded Python ints reduced modulo 2**32 (no masks shared with the
    tested code)."""
    state = (v * 747796405 + 2891336453) % U32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) % U32
    return (word >> 22) ^ word


def _ref_uniform(seed: int, i: int) -> float:
    z = (seed + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    z ^= z >> 31
    k0, k1 = z % U32, z // U32
    words = [_ref_pcg(_ref_pcg(_ref_pcg((2 * i + w) % U32) ^ k0) ^ k1) for w in (0, 1)]
    return (words[0] * 2**21 + words[1] // 2**11) / 2**53


def _draws(seed: int, start: int, n: int) -> list[float]:
    """Draws start .. start + n - 1 of seed's key, computed with numpy."""
    s = UniformStream(seed)
    return uniforms_at(np.int64(s.key0), np.int64(s.key1), np.arange(start, start + n, dtype=np.int64)).tolist()


@pytest.mark.parametrize("seed", [0, 1, 42, 2**32 + 7, 2**64 - 1])
def test_values_equal_the_reference(seed):
    """The first 40 draws, and 40 around the index wrap (word index 2 i taken modulo 2**32)."""
    got = _draws(seed, 0, 40)
    assert got == [_ref_uniform(seed, i) for i in range(40)]
    far = _draws(seed, 2**31 - 20, 40)
    assert far == [_ref_uniform(seed, i) for i in range(2**31 - 20, 2**31 + 20)]
    assert all(0.0 <= u < 1.0 for u in got + far)


def test_pinned_values():
    """Seed 7's first uniforms, pinned: a change of the hash changes every seeded request's samples."""
    assert _draws(7, 0, 3) == [_ref_uniform(7, i) for i in range(3)]
    assert [round(u, 12) for u in _draws(7, 0, 3)] == [0.526351207695, 0.996016821588, 0.859316396862]


def test_numpy_and_torch_agree():
    """``uniforms_at`` on tensors (keys and draws broadcast per row) gives numpy's numbers."""
    seeds, starts = [3, 99, 12345], [0, 17, 1000]
    keys = torch.tensor([key_words(s) for s in seeds])  # (3, 2)
    draws = torch.tensor(starts).view(-1, 1) + torch.arange(5)  # (3, 5)
    got = uniforms_at(keys[:, :1], keys[:, 1:], draws)  # (3, 5)
    assert got.dtype == torch.float64
    assert got.tolist() == [_draws(s, c, 5) for s, c in zip(seeds, starts)]


def _chi_uniform(u: np.ndarray, bins: int) -> float:
    counts = np.bincount(np.minimum((u * bins).astype(np.int64), bins - 1), minlength=bins)
    return float(scipy_stats.chisquare(counts).pvalue)


def test_one_key_is_uniform_and_serially_independent():
    """200,000 draws of one key: uniform over 100 bins; 100,000 disjoint consecutive pairs uniform over
    16 x 16 cells (chi-square, p > P_MIN each)."""
    u = np.array(_draws(2024, 0, 200_000))
    assert _chi_uniform(u, 100) > P_MIN
    pairs = np.minimum((u * 16).astype(np.int64), 15).reshape(-1, 2)
    assert _chi_uniform((pairs[:, 0] * 16 + pairs[:, 1] + 0.5) / 256, 256) > P_MIN


def test_distinct_seeds_and_draws_are_independent():
    """50,000 neighbouring seeds s, s + 1 (which share all but the low bits): their first draws are uniform over
    100 bins and jointly uniform over 16 x 16 cells; and one seed's draw i against its draw i + 2**20 (draws far
    apart) over 50,000 i, jointly uniform as well (chi-square, p > P_MIN each)."""
    k = np.array([key_words(s) for s in range(50_001)], dtype=np.int64)  # (S + 1, 2)
    first = uniforms_at(k[:, 0], k[:, 1], np.zeros(len(k), dtype=np.int64))  # (S + 1,)
    assert _chi_uniform(first[:-1], 100) > P_MIN
    a, b = (np.minimum((x * 16).astype(np.int64), 15) for x in (first[:-1], first[1:]))
    assert _chi_uniform((a * 16 + b + 0.5) / 256, 256) > P_MIN
    k0, k1 = key_words(5)
    draws = np.arange(50_000, dtype=np.int64)
    near, far = uniforms_at(k0, k1, draws), uniforms_at(k0, k1, draws + 2**20)
    a, b = (np.minimum((x * 16).astype(np.int64), 15) for x in (near, far))
    assert _chi_uniform((a * 16 + b + 0.5) / 256, 256) > P_MIN


def test_the_chi_square_has_power():
    """Negative control at the same sizes: a sequence whose pairs are correlated (u, u + 0.01 mod 1) fails the
    pair test, and numbers with a 1% excess in one bin fail the 100-bin test."""
    u = np.array(_draws(3, 0, 100_000))
    bad = np.stack([u, (u + 0.01) % 1.0], 1).reshape(-1)
    pairs = np.minimum((bad * 16).astype(np.int64), 15).reshape(-1, 2)
    assert _chi_uniform((pairs[:, 0] * 16 + pairs[:, 1] + 0.5) / 256, 256) < P_MIN
    skewed = np.array(_draws(4, 0, 200_000))
    skewed[:2_000] = 0.005  # 1% of the draws moved into bin 0
    assert _chi_uniform(skewed, 100) < P_MIN


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_numbers_equal_the_cpu_numbers():
    """The device computes the same bits: int64 arithmetic that never overflows, an exact float conversion."""
    seeds = list(range(0, 3000, 7)) + [2**63 + 5, 2**64 - 1]
    keys = torch.tensor([key_words(s) for s in seeds])
    draws = torch.randint(0, 2**31, (len(seeds), 65))  # (S, 65)
    cpu = uniforms_at(keys[:, :1], keys[:, 1:], draws)
    gpu = uniforms_at(keys[:, :1].cuda(), keys[:, 1:].cuda(), draws.cuda())
    assert torch.equal(gpu.cpu(), cpu)
