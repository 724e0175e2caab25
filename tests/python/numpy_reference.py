"""The float64 reference the Python tests compare against, written as the spec (DESIGN.md, sections
2-5): naive NumPy, one token at a time, double precision everywhere. Also the one table of
tolerances and the input generator every Python test uses."""

from __future__ import annotations

import numpy as np

# Relative error ||out - ref|| / ||ref|| allowed, by the inputs' dtype. f64 runs the library's
# double path, so only summation order differs; f32 and the 16-bit types follow DESIGN.md's rule.
TOLERANCE = {
    "float64": 1e-10,
    "float32": 1e-5,
    "bfloat16": 1e-2,
    "float16": 1e-2,
}
# A 16-bit head's weight gradient, summed over every token: in float32 within the 1e-3 of
# float64; rounded into 16 bits, at most this many times the error of float64 rounded once (one
# rounding of the float32 sum stays within a few percent of it; one per chunk of 8 is 2.1x).
GRAD_WEIGHT_F32_OF_16_BIT = 1e-3
ROUNDED_ONCE_RATIO = 1.25


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    scale = np.linalg.norm(ref.ravel())
    diff = np.linalg.norm((out - ref).ravel())
    return float(diff / scale) if scale > 0 else float(diff)


# ---- Inputs ----------------------------------------------------------------------------------


def make_logits(rng, n, v, dtype=np.float64):
    """Random logits with outliers, so softmax rows are far from uniform."""
    z = rng.standard_normal((n, v)) * 2.0
    hot = rng.integers(0, v, size=n)
    z[np.arange(n), hot] += 12.0  # one dominant entry per row
    z[rng.random((n, v)) < 0.01] -= 25.0  # a few nearly dead entries
    return z.astype(dtype)


def make_linear(rng, n, h, v, dtype=np.float64, bias=False):
    x = rng.standard_normal((n, h)).astype(dtype)
    w = (rng.standard_normal((v, h)) / np.sqrt(h) * 3.0).astype(dtype)
    w[rng.integers(0, v)] *= 4.0  # an outlier vocabulary row
    b = (rng.standard_normal(v) * 0.5).astype(dtype) if bias else None
    return x, w, b


def make_labels(rng, n, v, ignore_index=-100, ignored=2, dtype=np.int64):
    y = rng.integers(0, v, size=n).astype(dtype)
    y[rng.choice(n, size=min(ignored, n), replace=False)] = ignore_index
    return y


def make_teacher(rng, n, v, k, normalized=True, zeros=True):
    ids = np.stack([rng.choice(v, size=k, replace=False) for _ in range(n)]).astype(np.int64)
    p = rng.random((n, k)) + 0.05
    if zeros:
        p[0, -1] = 0.0  # a zero-probability entry contributes nothing
    p = p / p.sum(axis=1, keepdims=True)
    if not normalized:
        p *= 0.8  # a truncated teacher: the general formula still holds
    return ids, p


# ---- The per-token math ----------------------------------------------------------------------


def _scale(z, softcap, temperature):
    """s from z, and ds/dz."""
    z = np.asarray(z, dtype=np.float64)
    if softcap:
        capped = softcap * np.tanh(z / softcap)
        dcap = 1.0 - (capped / softcap) ** 2
    else:
        capped = z
        dcap = np.ones_like(z)
    return capped / temperature, dcap / temperature


def _lse(row):
    m = row.max()
    return m + np.log(np.exp(row - m).sum())


def loss_reference(z, labels=None, teacher_ids=None, teacher_probs=None, token_mask=None, *,
                   ignore_index=-100, reduction="mean", ce_weight=1.0, kd_weight=0.0,
                   label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0,
                   normalizer=None, grad_output=None):
    """(loss, lse, dL/dz) for logits z [N, V]. dL/dz is the gradient of the reduced loss times
    grad_output (a scalar, or [N] for "none"; 1 by default)."""
    z = np.asarray(z, dtype=np.float64)
    n, v = z.shape
    s, ds_dz = _scale(z, softcap, temperature)
    per_token = np.zeros(n)
    lse = np.zeros(n)
    dl_ds = np.zeros((n, v))  # d l_t / d s_t, per token, before reduction
    counted = np.ones(n, dtype=bool)
    for t in range(n):
        lse[t] = _lse(s[t])
        if labels is not None and labels[t] == ignore_index:
            counted[t] = False
        if token_mask is not None and not token_mask[t]:
            counted[t] = False
        if not counted[t]:
            continue
        p = np.exp(s[t] - lse[t])
        # The z-loss term is absent at 0, not 0 * inf^2, for an infinite lse.
        l_t = z_loss * lse[t] ** 2 if z_loss != 0.0 else 0.0
        g = 2.0 * z_loss * lse[t] * p if z_loss != 0.0 else np.zeros_like(p)
        if ce_weight != 0.0:
            y = int(labels[t])
            eps = label_smoothing
            ce = lse[t] - (1.0 - eps) * s[t, y] - (eps / v) * s[t].sum()
            l_t += ce_weight * ce
            onehot = np.zeros(v)
            onehot[y] = 1.0
            g = g + ce_weight * (p - (1.0 - eps) * onehot - eps / v)
        if kd_weight != 0.0:
            kd = 0.0
            target = np.zeros(v)
            for i, pk in zip(teacher_ids[t], teacher_probs[t]):
                if pk > 0:
                    kd += pk * (np.log(pk) - (s[t, int(i)] - lse[t]))
                target[int(i)] += pk
            l_t += kd_weight * kd
            g = g + kd_weight * (p * target.sum() - target)
        per_token[t] = l_t
        dl_ds[t] = g

    if reduction == "none":
        loss = per_token
        upstream = np.ones(n) if grad_output is None else np.asarray(grad_output, np.float64)
    else:
        denom = 1.0
        if reduction == "mean":
            denom = float(normalizer) if normalizer else float(counted.sum())
        loss = per_token.sum() / denom if denom > 0 else 0.0
        g0 = 1.0 if grad_output is None else float(grad_output)
        upstream = np.full(n, g0 / denom if denom > 0 else 0.0)
    dz = dl_ds * upstream[:, None] * ds_dz
    return loss, lse, dz


def linear_reference(x, w, b=None, **kwargs):
    """(loss, lse, dX, dW, db) through the head z = X W^T + b."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    z = x @ w.T
    if b is not None:
        z = z + np.asarray(b, np.float64)
    loss, lse, dz = loss_reference(z, **kwargs)
    return loss, lse, dz @ w, dz.T @ x, dz.sum(axis=0)


def topk_reference(z, k, *, softcap=None, temperature=1.0, renormalize=True):
    """(ids, probs, tail): the k largest scaled logits per row, ties to the lower id."""
    s, _ = _scale(z, softcap, temperature)
    n, v = s.shape
    ids = np.zeros((n, k), dtype=np.int64)
    probs = np.zeros((n, k))
    tail = np.zeros(n)
    for t in range(n):
        order = np.lexsort((np.arange(v), -s[t]))[:k]  # by value descending, then id ascending
        ids[t] = order
        if renormalize:
            sel = s[t, order]
            probs[t] = np.exp(sel - _lse(sel))
        else:
            probs[t] = np.exp(s[t, order] - _lse(s[t]))
            tail[t] = 1.0 - probs[t].sum()
    return ids, probs, tail
