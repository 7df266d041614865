"""Text embeddings for `analyze diversity`: a model's mean-pooled hidden states, or TF-IDF.

Both return one L2-normalised row per text, so a dot product is a cosine similarity.

* `ModelEmbedder`: our own JAX model (a project checkpoint or a Hugging Face directory, loaded by
  `inference.loading`), the final-normed hidden states averaged over each text's tokens; texts
  are batched, right-sized to length buckets (one compiled program per bucket) and cut to
  `max_tokens`.
* `tfidf`: scikit-learn's TF-IDF over all sources' texts together (one shared vocabulary),
  sparse.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def tfidf(texts: Sequence[str]) -> Any:
    """Sparse [n, vocab] TF-IDF rows (L2-normalised): lower-cased words of two letters or more,
    English stop words left out (shared function words would make every two sources look alike),
    sublinear tf."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    return TfidfVectorizer(sublinear_tf=True, stop_words="english").fit_transform(texts)


class ModelEmbedder:
    def __init__(
        self, path: str, *, tokenizer: str | None = None, max_tokens: int = 256, batch_size: int = 16
    ):
        from agentrefine_jax.data.tokenizers import load_tokenizer
        from agentrefine_jax.inference.loading import load_for_inference

        loaded = load_for_inference(path, dtype="float32")
        name = tokenizer or loaded.tokenizer
        if not name:
            raise ValueError(f"{path}: no tokenizer recorded or shipped with the model; pass --tokenizer")
        self.model = loaded.model
        self.tokenizer = load_tokenizer(name)
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.hidden_size = loaded.cfg.hidden_size

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: self.max_tokens]
        return ids or [self.tokenizer.eos_token_id or 0]

    def __call__(self, texts: Sequence[str], progress: Callable[[int], None] | None = None) -> np.ndarray:
        from flax import nnx

        from agentrefine_jax.inference.engine import bucket, left_pad

        graphdef, state = nnx.split(self.model)
        out = np.zeros((len(texts), self.hidden_size), np.float32)
        encoded = [self.encode(t) for t in texts]
        # Similar lengths together: fewer padded tokens and fewer distinct program shapes.
        order = sorted(range(len(texts)), key=lambda i: len(encoded[i]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            prompts = [encoded[i] for i in idx]
            ids, pos, seg = left_pad(prompts, bucket(max(map(len, prompts))), self.batch_size)
            pooled = np.asarray(_mean_hidden_program()(graphdef, state, ids, pos, seg))
            out[idx] = pooled[: len(idx)]
            if progress:
                progress(len(idx))
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)


@functools.cache
def _mean_hidden_program() -> Callable[..., Any]:
    """The jitted pooled forward (built on first use: TF-IDF runs never import jax)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def pooled(graphdef: Any, state: Any, ids: Any, pos: Any, seg: Any) -> Any:
        model = nnx.merge(graphdef, state)
        hidden, _ = model.forward(ids, pos, seg)
        mask = (seg > 0).astype(jnp.float32)[..., None]
        return (hidden.astype(jnp.float32) * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)

    return jax.jit(pooled, static_argnums=0)
