"""Exact most / least similar search by inner product, streamed over the pool in chunks."""

from __future__ import annotations

import numpy as np


def _keep(scores: np.ndarray, ids: np.ndarray, k: int, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    """The k best columns per row, sorted best first."""
    key = -scores if largest else scores
    if k < scores.shape[1]:
        part = np.argpartition(key, k - 1, axis=1)[:, :k]
        scores, ids, key = (np.take_along_axis(a, part, 1) for a in (scores, ids, key))
    order = np.argsort(key, axis=1, kind="stable")
    return np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)


def extreme_inner_product(queries: np.ndarray, pool: np.ndarray, k: int, chunk_size: int) -> dict[str, np.ndarray]:
    """Top-k largest and smallest ``queries @ pool.T`` per query, exactly.

    queries: (Q, d), pool: (N, d). Only a (Q, chunk_size) score block is alive at a time, so a
    pool of millions fits in memory. Returns ``max_idx``, ``max_score`` (descending) and
    ``min_idx``, ``min_score`` (ascending), each (Q, min(k, N)).
    """
    if queries.ndim != 2 or pool.ndim != 2 or queries.shape[1] != pool.shape[1]:
        raise ValueError(f"shape mismatch: queries {queries.shape}, pool {pool.shape}")
    if chunk_size < 1 or k < 1:
        raise ValueError("chunk_size and k must be >= 1")
    q = np.ascontiguousarray(queries, dtype=np.float32)
    nq, n = q.shape[0], pool.shape[0]
    k = min(k, n)
    hi_s = lo_s = np.zeros((nq, 0), np.float32)
    hi_i = lo_i = np.zeros((nq, 0), np.int64)
    for start in range(0, n, chunk_size):
        block = np.ascontiguousarray(pool[start : start + chunk_size], dtype=np.float32)
        scores = q @ block.T  # (Q, C)
        idx = np.broadcast_to(np.arange(start, start + block.shape[0], dtype=np.int64), scores.shape)
        # The global top-k always lies within (running top-k ∪ this chunk): merging is exact.
        hi_s, hi_i = _keep(np.concatenate([hi_s, scores], 1), np.concatenate([hi_i, idx], 1), k, largest=True)
        lo_s, lo_i = _keep(np.concatenate([lo_s, scores], 1), np.concatenate([lo_i, idx], 1), k, largest=False)
    return {"max_idx": hi_i, "max_score": hi_s, "min_idx": lo_i, "min_score": lo_s}
