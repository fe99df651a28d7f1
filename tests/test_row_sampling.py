"""The padded batch's per-row pieces: ``row_sampling.shape_probs_rows`` shapes each row as ``shape_probs`` does
with that row's parameters, and ``acceptance_batched.pad_trees`` lays trees out as their host rows say."""

from __future__ import annotations

import pytest
import torch

from specdec.acceptance import shape_probs
from specdec.acceptance_batched import pad_trees
from specdec.row_sampling import sampling_rows, shape_probs_rows
from specdec.sampling_params import SamplingParams
from specdec.tree import DraftTree


def test_shape_probs_rows_equals_shape_probs():
    """Greedy, plain and filtered rows in one batch (ties keep the lower ids); without filtered rows the batch is a
    plain softmax."""
    g = torch.Generator().manual_seed(2)
    logits = 3.0 * torch.randn(6, 4, 9, generator=g)  # (B, Q, V)
    logits[2, :, 3:5] = logits[2, :, 2:3]
    params = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (0.5, 4, 0.8), (2.0, 20, 1.0)]
    sampling = sampling_rows([SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in params], "cpu")
    got = shape_probs_rows(logits, sampling)
    for row, (t, k, p) in enumerate(params):
        assert torch.allclose(got[row], shape_probs(logits[row], t, k, p), rtol=0, atol=1e-7), row
    plain = sampling_rows([SamplingParams(temperature=1.0)] * 6, "cpu")
    assert not plain.filtered and not plain.any_greedy
    assert torch.allclose(shape_probs_rows(logits, plain), torch.softmax(logits, -1), rtol=0, atol=1e-7)


def test_pad_trees_layout_and_a_tree_too_big():
    tree = DraftTree.from_parents([5, 6, 7], [-1, -1, 0])
    padded = pad_trees([tree, DraftTree.empty()], 5, "cpu")
    masks, parents = tree.verify_rows()
    assert padded.tokens.tolist() == [[0, 5, 6, 7, 0], [0] * 5]
    assert padded.parents.tolist() == [parents + [-1], [-1] * 5]
    assert padded.tree_mask.tolist() == [masks + [0], [1, 0, 0, 0, 0]]
    assert padded.num_tokens.tolist() == [4, 1]
    with pytest.raises(ValueError, match=r"trees\[0\] has 3 nodes"):
        pad_trees([tree], 3, "cpu")
