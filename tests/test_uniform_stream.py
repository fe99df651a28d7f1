"""The counter-based verification uniforms (``specdec.uniform_stream``): values against a plain-Python reference,
the same numbers from numpy, torch and the padded device layout, uniformity and independence by chi-square
(sample counts stated next to each test, P_MIN as the other chi-square tests), and counters that advance by
the draws used. The CUDA test compares the GPU's numbers with the CPU's bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.acceptance_stochastic import draw_uniforms
from specdec.tree import DraftTree
from specdec.uniform_stream import UniformStream, key_words, padded_uniforms, uniforms_at

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


@pytest.mark.parametrize("seed", [0, 1, 42, 2**32 + 7, 2**64 - 1])
def test_values_equal_the_reference(seed):
    """The first 40 draws, and 40 after a counter near the index wrap (word index 2 i taken modulo 2**32)."""
    s = UniformStream(seed)
    got = s.take(40)
    assert got == [_ref_uniform(seed, i) for i in range(40)]
    far = UniformStream(seed, 2**31 - 20).take(40)
    assert far == [_ref_uniform(seed, i) for i in range(2**31 - 20, 2**31 + 20)]
    assert s.counter == 40 and all(0.0 <= u < 1.0 for u in got + far)


def test_pinned_values():
    """Seed 7's first uniforms, pinned: a change of the hash changes every seeded request's samples."""
    assert UniformStream(7).take(3) == [_ref_uniform(7, i) for i in range(3)]
    assert [round(u, 12) for u in UniformStream(7).take(3)] == [0.526351207695, 0.996016821588, 0.859316396862]


def test_numpy_torch_and_padded_layout_agree():
    """``take`` (numpy), ``uniforms_at`` on tensors and ``padded_uniforms`` give the same numbers; the padded
    layout puts draw counter + c - 1 at column c >= 1 and the bonus draw counter + n at column 0."""
    seeds, counters, nodes, q = [3, 99, 12345], [0, 17, 1000], [4, 0, 2], 6
    streams = [UniformStream(s, c) for s, c in zip(seeds, counters)]
    want = [st.take(n + 1) for st, n in zip(streams, nodes)]
    keys = torch.tensor([key_words(s) for s in seeds])  # (3, 2)
    got = padded_uniforms(keys[:, 0], keys[:, 1], torch.tensor(counters), torch.tensor(nodes) + 1, q)
    for row, w, n in zip(got.tolist(), want, nodes):
        assert row[1:n + 1] == w[:n] and row[0] == w[n]
    flat = uniforms_at(keys[0, 0], keys[0, 1], torch.arange(5)).tolist()
    assert flat == UniformStream(3).take(5)


def test_draw_uniforms_advances_only_the_rows_with_a_stream():
    trees = [DraftTree.chain([5, 6, 7]), DraftTree.empty(), DraftTree.chain([1])]
    streams = [UniformStream(1), None, UniformStream(2, 10)]
    u = draw_uniforms(streams, trees, 5, "cpu")  # (3, 5)
    assert [s.counter for s in (streams[0], streams[2])] == [4, 12]
    assert u[1].tolist() == [0.0] * 5
    assert u[0, [1, 2, 3, 0]].tolist() == UniformStream(1).take(4)
    assert u[2, [1, 0]].tolist() == UniformStream(2, 10).take(2)


def _chi_uniform(u: np.ndarray, bins: int) -> float:
    counts = np.bincount(np.minimum((u * bins).astype(np.int64), bins - 1), minlength=bins)
    return float(scipy_stats.chisquare(counts).pvalue)


def test_one_stream_is_uniform_and_serially_independent():
    """200,000 draws of one stream: uniform over 100 bins; 100,000 disjoint consecutive pairs uniform over
    16 x 16 cells (chi-square, p > P_MIN each)."""
    u = np.array(UniformStream(2024).take(200_000))
    assert _chi_uniform(u, 100) > P_MIN
    pairs = np.minimum((u * 16).astype(np.int64), 15).reshape(-1, 2)
    assert _chi_uniform((pairs[:, 0] * 16 + pairs[:, 1] + 0.5) / 256, 256) > P_MIN


def test_distinct_seeds_and_counters_are_independent():
    """50,000 neighbouring seeds s, s + 1 (which share all but the low bits): their first draws are uniform over
    100 bins and jointly uniform over 16 x 16 cells; and one seed's draw i against its draw i + 2**20 (counters far
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
    """Negative control at the same sizes: a stream whose pairs are correlated (u, u + 0.01 mod 1) fails the
    pair test, and numbers with a 1% excess in one bin fail the 100-bin test."""
    u = np.array(UniformStream(3).take(100_000))
    bad = np.stack([u, (u + 0.01) % 1.0], 1).reshape(-1)
    pairs = np.minimum((bad * 16).astype(np.int64), 15).reshape(-1, 2)
    assert _chi_uniform((pairs[:, 0] * 16 + pairs[:, 1] + 0.5) / 256, 256) < P_MIN
    skewed = np.array(UniformStream(4).take(200_000))
    skewed[:2_000] = 0.005  # 1% of the draws moved into bin 0
    assert _chi_uniform(skewed, 100) < P_MIN


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_numbers_equal_the_cpu_numbers():
    """The device computes the same bits: int64 arithmetic that never overflows, an exact float conversion."""
    seeds = list(range(0, 3000, 7)) + [2**63 + 5, 2**64 - 1]
    keys = torch.tensor([key_words(s) for s in seeds])
    counters = torch.randint(0, 2**31, (len(seeds),))
    nodes = torch.randint(1, 65, (len(seeds),))
    cpu = padded_uniforms(keys[:, 0], keys[:, 1], counters, nodes, 65)
    gpu = padded_uniforms(keys[:, 0].cuda(), keys[:, 1].cuda(), counters.cuda(), nodes.cuda(), 65)
    assert torch.equal(gpu.cpu(), cpu)
