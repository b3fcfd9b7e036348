"""The float32 operations the numpy blocks are made of (each the same math as its torch function)."""

from __future__ import annotations

import numpy as np

F32 = np.float32
# erf as a rational function on [-4, 4] (Eigen's float erf, also XLA's): within a few float32 ulps of
# the exact erf (tests/node/test_lean_engine.py checks it against math.erf), and erf is +-1 in float32 past 4.
_ERF_ALPHA = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
_ERF_BETA = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)


def erf(x: np.ndarray) -> np.ndarray:
    x = np.clip(x, F32(-4.0), F32(4.0))
    x2 = x * x
    p = np.full_like(x, F32(_ERF_ALPHA[0]))
    for c in _ERF_ALPHA[1:]:
        p = p * x2 + F32(c)
    q = np.full_like(x, F32(_ERF_BETA[0]))
    for c in _ERF_BETA[1:]:
        q = q * x2 + F32(c)
    return (x * p / q).astype(F32, copy=False)


def gelu(x: np.ndarray) -> np.ndarray:
    """The exact (erf) GELU, torch's default."""
    return F32(0.5) * x * (F32(1.0) + erf(x * F32(0.7071067811865476)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (F32(1.0) + np.exp(-x))


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x (..., in) @ weight (out, in).T + bias (out,): torch's Linear layout."""
    out = x @ weight.T
    return out + bias if bias is not None else out


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True)
    return centred / np.sqrt(var + F32(eps)) * weight + bias


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return weight * (x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + F32(eps)))


def softmax(scores: np.ndarray) -> np.ndarray:
    """Along the last axis; a row of -inf everywhere (nothing to attend to) is not expected here."""
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
    """Scaled dot-product attention: q (..., Tq, hs), k and v (..., S, hs); allowed (broadcast to
    (..., Tq, S)) True where a query may see a key (None: all)."""
    scores = (q @ np.swapaxes(k, -1, -2)) * F32(1.0 / np.sqrt(q.shape[-1]))
    if allowed is not None:
        scores = np.where(allowed, scores, F32(-np.inf))
    return softmax(scores) @ v
