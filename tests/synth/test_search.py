"""Exact chunked max/min inner-product search against a brute-force computation."""

from __future__ import annotations

import numpy as np
import pytest

from rolemrc.synth.search import extreme_inner_product


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("k", [1, 3])
def test_matches_brute_force(chunk: int, k: int) -> None:
    rng = np.random.default_rng(chunk * 10 + k)
    q = rng.standard_normal((9, 16)).astype(np.float32)
    pool = rng.standard_normal((103, 16)).astype(np.float32)
    got = extreme_inner_product(q, pool, k, chunk)
    full = q @ pool.T
    np.testing.assert_array_equal(got["max_idx"], np.argsort(-full, axis=1)[:, :k])
    np.testing.assert_array_equal(got["min_idx"], np.argsort(full, axis=1)[:, :k])
    np.testing.assert_allclose(got["max_score"], -np.sort(-full, axis=1)[:, :k], rtol=1e-6)
    np.testing.assert_allclose(got["min_score"], np.sort(full, axis=1)[:, :k], rtol=1e-6)


def test_k_larger_than_pool_and_errors() -> None:
    q = np.eye(3, dtype=np.float32)
    pool = np.array([[1, 0, 0], [0, 2, 0]], dtype=np.float32)
    got = extreme_inner_product(q, pool, 5, 1)
    assert got["max_idx"].shape == got["min_idx"].shape == (3, 2)
    assert got["max_idx"][:2].tolist() == [[0, 1], [1, 0]]
    assert got["min_idx"][:2].tolist() == [[1, 0], [0, 1]]
    assert sorted(got["max_idx"][2].tolist()) == [0, 1]  # a tie: both, in either order
    with pytest.raises(ValueError, match="shape mismatch"):
        extreme_inner_product(q, np.zeros((2, 4), np.float32), 1, 2)
