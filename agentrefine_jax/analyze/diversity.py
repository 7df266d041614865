"""`analyze diversity` (Figures 6 and 7): how varied each source's Thoughts are, and how alike the
sources' environments are.

* diversity of a source = mean pairwise cosine distance between its Thoughts' embeddings
  (pairs of distinct turns);
* Figure 7's cell (a, b) = mean cosine similarity between a's and b's environment embeddings
  (the diagonal over distinct pairs within a source);
* Figure 6 = t-SNE (scikit-learn, fixed seed) of every sampled Thought, after a seeded reduction
  to at most 50 dimensions (TruncatedSVD for TF-IDF, PCA for model embeddings).

Means over all pairs come from row sums (rows are unit vectors), so no n x n matrix is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from agentrefine_jax.analyze.texts import SourceTexts


@dataclasses.dataclass
class Embedded:
    sources: list[SourceTexts]
    thoughts: list[Any]  # per source: [n_i, d] rows, unit norm (scipy sparse or numpy)
    environments: list[Any]


def _sum_rows(x: Any) -> np.ndarray:
    return np.asarray(x.sum(axis=0)).ravel()


def _sq_norms(x: Any) -> float:
    return float(x.multiply(x).sum()) if hasattr(x, "multiply") else float((x * x).sum())


def mean_similarity(a: Any, b: Any | None = None) -> float:
    """Mean cosine similarity over all (row of a, row of b) pairs; with b None, over distinct pairs of a."""
    sa = _sum_rows(a)
    if b is None:
        n = a.shape[0]
        if n < 2:
            return float("nan")
        return float((sa @ sa - _sq_norms(a)) / (n * (n - 1)))
    return float(sa @ _sum_rows(b) / (a.shape[0] * b.shape[0]))


def similarity_matrix(groups: Sequence[Any]) -> np.ndarray:
    k = len(groups)
    m = np.zeros((k, k))
    for i in range(k):
        for j in range(k):
            m[i, j] = mean_similarity(groups[i]) if i == j else mean_similarity(groups[i], groups[j])
    return m


def diversity(x: Any) -> float:
    """Mean pairwise cosine distance between distinct rows."""
    return 1.0 - mean_similarity(x)


def embed_sources(
    sources: Sequence[SourceTexts],
    embed: Callable[[Sequence[str]], Any],
) -> Embedded:
    """Embed every source's Thoughts and environments in one call (TF-IDF shares one vocabulary)."""
    texts = [t for s in sources for _, _, t in s.thoughts] + [e for s in sources for _, e in s.environments]
    vectors = embed(texts)
    sizes = [len(s.thoughts) for s in sources] + [len(s.environments) for s in sources]
    bounds = np.cumsum([0, *sizes])
    parts = [vectors[bounds[i] : bounds[i + 1]] for i in range(len(sizes))]
    k = len(sources)
    return Embedded(list(sources), parts[:k], parts[k:])


def tsne(parts: Sequence[Any], seed: int, threads: int | None = None) -> np.ndarray:
    """[n, 2] t-SNE coordinates of the stacked rows of `parts` (deterministic for a seed).

    `threads` caps the OpenMP/BLAS threads: on a busy machine, spinning OpenMP workers that wait
    for each other make scikit-learn's t-SNE many times slower than one thread.
    """
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=threads):
        return _tsne(parts, seed)


def _tsne(parts: Sequence[Any], seed: int) -> np.ndarray:
    import scipy.sparse
    from sklearn.decomposition import PCA, TruncatedSVD
    from sklearn.manifold import TSNE

    sparse = scipy.sparse.issparse(parts[0])
    x = scipy.sparse.vstack(parts).tocsr() if sparse else np.vstack(parts)
    n, d = x.shape
    if n < 5:
        raise ValueError(f"t-SNE needs at least 5 Thoughts, got {n}")
    dims = min(50, d - 1, n - 1)
    if dims >= 2:
        reducer = TruncatedSVD(dims, random_state=seed) if sparse else PCA(dims, random_state=seed)
        x = reducer.fit_transform(x)
    elif sparse:
        x = x.toarray()
    perplexity = float(min(30.0, (n - 1) / 3))
    model = TSNE(2, perplexity=perplexity, init="pca", random_state=seed, method="barnes_hut")
    return model.fit_transform(np.asarray(x, np.float64))
