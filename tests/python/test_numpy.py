"""The NumPy path on the CPU against the float64 NumPy reference: every function and option,
leading batch dimensions, strided views, and the reference checked against finite differences."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import lmloss
from numpy_reference import (
    TOLERANCE,
    linear_reference,
    loss_reference,
    make_labels,
    make_linear,
    make_logits,
    make_teacher,
    rel_err,
    topk_reference,
)

DTYPES = ["float64", "float32"]
REDUCTIONS = ["mean", "sum", "none"]
OPTIONS = {
    "plain": {},
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-3},
    "softcap": {"softcap": 5.0},
    "temperature": {"temperature": 2.0},
    "normalizer": {"normalizer": 100.0},
    "ignore_index": {"ignore_index": 3},
    "all": {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 8.0, "temperature": 0.7,
            "normalizer": 37.0},
}
N, H, V = 13, 24, 257  # an odd vocabulary, so no tile divides it


def check(out, ref, dtype, what):
    err = rel_err(out, ref)
    assert err <= TOLERANCE[dtype], f"{what}: relative error {err:.3g} > {TOLERANCE[dtype]:g}"


def check_rounded_once(r16, r32):
    """A 16-bit gradient summed in float32 and rounded once, against the float32 gradient of the
    same call. The 16-bit one's sum may come from BLAS products over two blocks of rows (its own
    bytes and a tail), whose last bits BLAS may round otherwise than one product's; so where the
    float32 value lies within 4 of its ulps of a midpoint of the 16-bit type, either neighbour
    of that midpoint is its rounding. Everywhere else the two are equal."""
    want = r32.astype(r16.dtype)
    differ = r16 != want
    if not differ.any():
        return
    lo, hi = np.minimum(r16[differ], want[differ]), np.maximum(r16[differ], want[differ])
    assert np.array_equal(np.nextafter(lo, np.array(np.inf, r16.dtype)), hi), \
        "a 16-bit gradient further than one step from its float32 sum rounded"
    x = r32[differ].astype(np.float64)
    midpoint = (lo.astype(np.float64) + hi.astype(np.float64)) / 2
    assert np.all(np.abs(x - midpoint) <= 4 * np.spacing(np.abs(r32[differ]))), \
        "a 16-bit gradient rounded away from its float32 sum"


def check_loss(out, ref, reduction, dtype):
    if reduction == "none":
        assert isinstance(out, np.ndarray)
    else:
        assert isinstance(out, float)
    check(out, ref, dtype, "loss")


# ---- The reference itself --------------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_reference_gradient_matches_finite_differences(reduction):
    """The reference's analytic gradient is the derivative of its loss (so the other tests
    compare against a correct gradient)."""
    rng = np.random.default_rng(1)
    n, v, k = 4, 9, 3
    z = make_logits(rng, n, v)
    y = make_labels(rng, n, v, ignored=1)
    ids, p = make_teacher(rng, n, v, k, normalized=False)
    kw = dict(labels=y, teacher_ids=ids, teacher_probs=p, ce_weight=0.6, kd_weight=0.7,
              label_smoothing=0.1, z_loss=0.01, softcap=4.0, temperature=1.3, reduction=reduction)
    g = rng.standard_normal(n) if reduction == "none" else 0.7
    _, _, dz = loss_reference(z, grad_output=g, **kw)
    num = np.zeros_like(z)
    h = 1e-6
    for i in range(n):
        for j in range(v):
            zp, zm = z.copy(), z.copy()
            zp[i, j] += h
            zm[i, j] -= h
            lp = np.sum(np.asarray(loss_reference(zp, **kw)[0]) * g)
            lm = np.sum(np.asarray(loss_reference(zm, **kw)[0]) * g)
            num[i, j] = (lp - lm) / (2 * h)
    assert rel_err(dz, num) < 1e-6


# ---- cross_entropy ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_cross_entropy(dtype, reduction, option):
    rng = np.random.default_rng(2)
    opts = OPTIONS[option]
    z = make_logits(rng, N, V, dtype)
    y = make_labels(rng, N, V, ignore_index=opts.get("ignore_index", -100))
    loss, lse, dz = loss_reference(z, y, reduction=reduction, **opts)
    r = lmloss.cross_entropy(z, y, reduction=reduction, grad=True, **opts)
    check_loss(r.loss, loss, reduction, dtype)
    check(r.lse, lse, dtype, "lse")
    assert r.grad_logits.dtype == z.dtype and r.grad_logits.shape == z.shape
    check(r.grad_logits, dz, dtype, "grad_logits")
    f = lmloss.cross_entropy(z, y, reduction=reduction, **opts)
    assert f.grad_logits is None
    check_loss(f.loss, loss, reduction, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_inplace_grad(dtype, reduction):
    rng = np.random.default_rng(3)
    z = make_logits(rng, N, V, dtype)
    y = make_labels(rng, N, V)
    loss, lse, dz = loss_reference(z, y, reduction=reduction, label_smoothing=0.05)
    r = lmloss.cross_entropy(z, y, reduction=reduction, label_smoothing=0.05, inplace_grad=True)
    assert r.grad_logits is z
    check_loss(r.loss, loss, reduction, dtype)
    check(z, dz, dtype, "gradient written over the logits")


def test_cross_entropy_int32_labels_and_all_ignored():
    rng = np.random.default_rng(4)
    z = make_logits(rng, 5, 11)
    y = np.full(5, -100, dtype=np.int32)
    r = lmloss.cross_entropy(z, y, grad=True)
    assert r.loss == 0.0
    assert not np.any(r.grad_logits)
    y[:3] = [1, 2, 3]
    loss, _, dz = loss_reference(z, y)
    r = lmloss.cross_entropy(z, y, grad=True)
    check(r.loss, loss, "float64", "loss")
    check(r.grad_logits, dz, "float64", "grad_logits")


def test_an_empty_batch():
    """No tokens: the reduced loss 0, the weight and bias gradients 0, the per-token outputs and
    top-k empty (arrays of no elements go in, whatever their strides)."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((50, 16)).astype(np.float32)
    b = rng.standard_normal(50).astype(np.float32)
    x, y = np.zeros((3, 0, 16), np.float32), np.zeros((3, 0), np.int64)
    for reduction in ("mean", "sum", "none"):
        r = lmloss.linear_cross_entropy(x, w, y, bias=b, reduction=reduction, grad=True)
        if reduction == "none":
            assert r.loss.shape == (3, 0)
        else:
            assert r.loss == 0.0
        assert r.lse.shape == (3, 0) and r.grad_hidden.shape == (3, 0, 16)
        assert not r.grad_weight.any() and not r.grad_bias.any()
    r = lmloss.cross_entropy(np.zeros((0, 50), np.float32), np.zeros(0, np.int32), grad=True)
    assert r.loss == 0.0 and r.grad_logits.shape == (0, 50)
    t = lmloss.topk(x, w, 4)
    assert t.ids.shape == (3, 0, 4) and t.probs.shape == (3, 0, 4) and t.tail.shape == (3, 0)


def test_cross_entropy_large_vocabulary():
    rng = np.random.default_rng(5)
    z = make_logits(rng, 3, 50257, np.float32)
    y = make_labels(rng, 3, 50257, ignored=0)
    loss, lse, dz = loss_reference(z, y)
    r = lmloss.cross_entropy(z, y, grad=True)
    check(r.loss, loss, "float32", "loss")
    check(r.lse, lse, "float32", "lse")
    check(r.grad_logits, dz, "float32", "grad_logits")


# ---- linear_cross_entropy --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("option", ["plain", "label_smoothing", "z_loss", "softcap",
                                    "temperature", "normalizer", "all"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy(dtype, reduction, option, bias):
    rng = np.random.default_rng(6)
    opts = OPTIONS[option]
    x, w, b = make_linear(rng, N, H, V, dtype, bias)
    y = make_labels(rng, N, V)
    loss, lse, dx, dw, db = linear_reference(x, w, b, labels=y, reduction=reduction, **opts)
    r = lmloss.linear_cross_entropy(x, w, y, bias=b, reduction=reduction, grad=True, **opts)
    check_loss(r.loss, loss, reduction, dtype)
    check(r.lse, lse, dtype, "lse")
    check(r.grad_hidden, dx, dtype, "grad_hidden")
    check(r.grad_weight, dw, dtype, "grad_weight")
    if bias:
        check(r.grad_bias, db, dtype, "grad_bias")
    else:
        assert r.grad_bias is None
    assert r.grad_logits is None


def test_linear_cross_entropy_without_grad_weight():
    rng = np.random.default_rng(7)
    x, w, b = make_linear(rng, N, H, V, bias=True)
    y = make_labels(rng, N, V)
    loss, _, dx, _, db = linear_reference(x, w, b, labels=y)
    r = lmloss.linear_cross_entropy(x, w, y, bias=b, grad=True, grad_weight=False)
    assert r.grad_weight is None
    check(r.grad_hidden, dx, "float64", "grad_hidden")
    check(r.grad_bias, db, "float64", "grad_bias")
    r = lmloss.linear_cross_entropy(x, w, y, bias=b)
    assert r.grad_hidden is None and r.grad_weight is None and r.grad_bias is None
    check(r.loss, loss, "float64", "loss")


def test_linear_cross_entropy_grad_weight_dtype():
    """A float16 head's weight gradient in float16 (summed in float32, rounded once) or, asked
    for, in float32; any other dtype is refused by name."""
    rng = np.random.default_rng(9)
    x, w, _ = make_linear(rng, N, H, V, "float32")
    x, w = x.astype(np.float16), w.astype(np.float16)
    y = make_labels(rng, N, V)
    _, _, _, dw, _ = linear_reference(x.astype(np.float64), w.astype(np.float64), labels=y)
    r16 = lmloss.linear_cross_entropy(x, w, y, grad=True)
    r32 = lmloss.linear_cross_entropy(x, w, y, grad=True, grad_weight_dtype=np.float32)
    assert r16.grad_weight.dtype == np.float16 and r32.grad_weight.dtype == np.float32
    assert rel_err(r32.grad_weight, dw) <= TOLERANCE["float32"]
    check_rounded_once(r16.grad_weight, r32.grad_weight)
    with pytest.raises(TypeError, match="grad_weight"):
        lmloss.linear_cross_entropy(x.astype(np.float32), w.astype(np.float32), y, grad=True,
                                    grad_weight_dtype="float64")


def test_sixteen_bit_weight_gradient_beyond_the_workspace_budget():
    """A float16 head's weight gradient is summed in float32 over its own bytes and an array of
    the call's, not in workspace: a budget smaller than that float32 sum still serves, with the
    same result as a float32 gradient rounded once."""
    rng = np.random.default_rng(10)
    n, h, v = 64, 64, 4099  # the float32 sum: 1 MiB
    x, w, _ = make_linear(rng, n, h, v, "float32")
    x, w = x.astype(np.float16), w.astype(np.float16)
    y = make_labels(rng, n, v)
    before = lmloss.workspace_budget()
    try:
        lmloss.set_workspace_budget(256 * 1024)
        r16 = lmloss.linear_cross_entropy(x, w, y, grad=True)
        r32 = lmloss.linear_cross_entropy(x, w, y, grad=True, grad_weight_dtype="float32")
    finally:
        lmloss.set_workspace_budget(before)
    check_rounded_once(r16.grad_weight, r32.grad_weight)


def test_linear_cross_entropy_small_workspace_budget():
    """A budget that holds only a few rows forces many chunks; the results do not change."""
    rng = np.random.default_rng(8)
    x, w, _ = make_linear(rng, 40, H, V)
    y = make_labels(rng, 40, V)
    loss, _, dx, dw, _ = linear_reference(x, w, labels=y)
    before = lmloss.workspace_budget()
    try:
        lmloss.set_workspace_budget(64 * 1024)
        r = lmloss.linear_cross_entropy(x, w, y, grad=True)
    finally:
        lmloss.set_workspace_budget(before)
    check(r.loss, loss, "float64", "loss")
    check(r.grad_hidden, dx, "float64", "grad_hidden")
    check(r.grad_weight, dw, "float64", "grad_weight")


# ---- linear_distill --------------------------------------------------------------------------

DISTILL = {
    "kd_only": dict(),
    "kd_mask": dict(mask=True),
    "ce_and_kd": dict(labels=True, ce_weight=0.5, kd_weight=0.5),
    "labels_count_only": dict(labels=True),
    "scaled": dict(labels=True, ce_weight=0.3, kd_weight=1.0, temperature=2.0, softcap=6.0,
                   z_loss=1e-3, label_smoothing=0.1),
    "unnormalized": dict(normalized=False, mask=True),
    "normalizer": dict(normalizer=50.0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(DISTILL))
def test_linear_distill(dtype, reduction, case):
    rng = np.random.default_rng(9)
    spec = dict(DISTILL[case])
    k = 5
    x, w, b = make_linear(rng, N, H, V, dtype, bias=True)
    ids, p = make_teacher(rng, N, V, k, normalized=spec.pop("normalized", True))
    probs = p.astype(dtype)
    y = make_labels(rng, N, V) if spec.pop("labels", False) else None
    mask = None
    if spec.pop("mask", False):
        mask = rng.random(N) < 0.7
        mask[0] = True
    opts = dict(spec)
    loss, lse, dx, dw, db = linear_reference(
        x, w, b, labels=y, teacher_ids=ids, teacher_probs=probs, token_mask=mask,
        reduction=reduction, ce_weight=opts.pop("ce_weight", 0.0),
        kd_weight=opts.pop("kd_weight", 1.0), **opts)
    r = lmloss.linear_distill(x, w, ids, probs, bias=b, labels=y, token_mask=mask,
                              reduction=reduction, grad=True, **spec)
    check_loss(r.loss, loss, reduction, dtype)
    check(r.lse, lse, dtype, "lse")
    check(r.grad_hidden, dx, dtype, "grad_hidden")
    check(r.grad_weight, dw, dtype, "grad_weight")
    check(r.grad_bias, db, dtype, "grad_bias")


def test_linear_distill_int32_ids_and_uint8_mask():
    rng = np.random.default_rng(10)
    x, w, _ = make_linear(rng, N, H, V)
    ids, p = make_teacher(rng, N, V, 4)
    mask = (rng.random(N) < 0.5).astype(np.uint8)
    mask[0] = 1
    loss, _, dx, dw, _ = linear_reference(x, w, teacher_ids=ids, teacher_probs=p,
                                          token_mask=mask, ce_weight=0.0, kd_weight=1.0)
    r = lmloss.linear_distill(x, w, ids.astype(np.int32), p, token_mask=mask, grad=True)
    check(r.loss, loss, "float64", "loss")
    check(r.grad_hidden, dx, "float64", "grad_hidden")
    check(r.grad_weight, dw, "float64", "grad_weight")


# ---- topk ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("scaling", [{}, {"temperature": 2.0}, {"softcap": 3.0},
                                     {"temperature": 0.5, "softcap": 10.0}])
def test_topk_logits(dtype, renormalize, scaling):
    rng = np.random.default_rng(11)
    k = 7
    z = make_logits(rng, N, V, dtype)
    # Ties across the k-th place: the lower id must win.
    z[1, [10, 20, 30, 40, 50, 60, 70, 80, 90]] = 30.0
    z[2, :] = 0.0
    ids, probs, tail = topk_reference(z, k, renormalize=renormalize, **scaling)
    r = lmloss.topk_logits(z, k, renormalize=renormalize, **scaling)
    assert r.ids.dtype == np.int32 and r.ids.shape == (N, k)
    np.testing.assert_array_equal(r.ids, ids)
    check(r.probs, probs, dtype, "probs")
    if renormalize:
        assert not np.any(r.tail)
    else:
        check(r.tail, tail, dtype, "tail")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_topk_linear(dtype, renormalize, bias):
    rng = np.random.default_rng(12)
    k = 4
    x, w, b = make_linear(rng, N, H, V, dtype, bias)
    z = x.astype(np.float64) @ w.astype(np.float64).T + (0 if b is None else b)
    ids, probs, tail = topk_reference(z, k, temperature=1.5, renormalize=renormalize)
    r = lmloss.topk(x, w, k, bias=b, temperature=1.5, renormalize=renormalize)
    np.testing.assert_array_equal(r.ids, ids)
    check(r.probs, probs, dtype, "probs")
    if not renormalize:
        check(r.tail, tail, dtype, "tail")


def test_topk_feeds_distill():
    """The teacher's own top-k, renormalised, distilled into itself: KL is 0 where the teacher's
    top-k holds all of its mass, positive otherwise."""
    rng = np.random.default_rng(13)
    x, w, _ = make_linear(rng, N, H, V)
    t = lmloss.topk(x, w, V)
    r = lmloss.linear_distill(x, w, t.ids, t.probs)
    assert abs(r.loss) < 1e-9
    t = lmloss.topk(x, w, 3)
    assert lmloss.linear_distill(x, w, t.ids, t.probs).loss > 0


# ---- Shapes and layouts ----------------------------------------------------------------------


def test_batch_dimensions():
    rng = np.random.default_rng(14)
    x, w, b = make_linear(rng, 12, H, V, bias=True)
    y = make_labels(rng, 12, V)
    ids, p = make_teacher(rng, 12, V, 3)
    x3, y3 = x.reshape(2, 2, 3, H), y.reshape(2, 2, 3)
    for reduction in REDUCTIONS:
        flat = lmloss.linear_cross_entropy(x, w, y, bias=b, reduction=reduction, grad=True)
        r = lmloss.linear_cross_entropy(x3, w, y3, bias=b, reduction=reduction, grad=True)
        if reduction == "none":
            assert r.loss.shape == (2, 2, 3)
            np.testing.assert_array_equal(r.loss.reshape(-1), flat.loss)
        else:
            assert r.loss == flat.loss
        assert r.lse.shape == (2, 2, 3)
        assert r.grad_hidden.shape == x3.shape
        np.testing.assert_array_equal(r.grad_hidden.reshape(12, H), flat.grad_hidden)
        np.testing.assert_array_equal(r.grad_weight, flat.grad_weight)

    z = x @ w.T
    flat = lmloss.cross_entropy(z, y, reduction="none", grad=True)
    r = lmloss.cross_entropy(z.reshape(3, 4, V), y.reshape(3, 4), reduction="none", grad=True)
    assert r.loss.shape == (3, 4) and r.grad_logits.shape == (3, 4, V)
    np.testing.assert_array_equal(r.grad_logits.reshape(12, V), flat.grad_logits)

    flat = lmloss.linear_distill(x, w, ids, p, reduction="none")
    r = lmloss.linear_distill(x3, w, ids.reshape(2, 2, 3, 3), p.reshape(2, 2, 3, 3),
                              reduction="none")
    np.testing.assert_array_equal(r.loss.reshape(-1), flat.loss)

    t = lmloss.topk(x3, w, 5)
    assert t.ids.shape == (2, 2, 3, 5) and t.probs.shape == (2, 2, 3, 5)
    assert t.tail.shape == (2, 2, 3)
    np.testing.assert_array_equal(t.ids.reshape(12, 5), lmloss.topk(x, w, 5).ids)


def test_single_token_without_batch_dimension():
    rng = np.random.default_rng(15)
    x, w, _ = make_linear(rng, 1, H, V)
    y = make_labels(rng, 1, V, ignored=0)
    r = lmloss.linear_cross_entropy(x[0], w, y[0], reduction="none", grad=True)
    assert r.loss.shape == () and r.grad_hidden.shape == (H,)
    loss, _, dx, _, _ = linear_reference(x, w, labels=y, reduction="none")
    check(r.loss.reshape(1), loss, "float64", "loss")
    check(r.grad_hidden.reshape(1, H), dx, "float64", "grad_hidden")


def test_strided_views():
    """Row views into a wider buffer go in without a copy; a transposed weight is copied."""
    rng = np.random.default_rng(16)
    wide = make_logits(rng, N, V + 19)
    z = wide[:, 5:5 + V]
    y = make_labels(rng, N, V)
    loss, _, dz = loss_reference(z, y)
    r = lmloss.cross_entropy(z, y, grad=True)
    check(r.loss, loss, "float64", "loss")
    check(r.grad_logits, dz, "float64", "grad_logits")
    before = wide.copy()
    lmloss.cross_entropy(z, y, inplace_grad=True)
    check(z, dz, "float64", "gradient written into the view")
    np.testing.assert_array_equal(wide[:, :5], before[:, :5])  # outside the view: untouched
    np.testing.assert_array_equal(wide[:, 5 + V:], before[:, 5 + V:])

    x, w, _ = make_linear(rng, N, H, V)
    wt = np.asfortranarray(w)  # columns contiguous: the library cannot describe it in place
    loss, _, dx, dw, _ = linear_reference(x, w, labels=y)
    r = lmloss.linear_cross_entropy(x, wt, y, grad=True)
    check(r.loss, loss, "float64", "loss")
    check(r.grad_weight, dw, "float64", "grad_weight")
    every_other = np.repeat(x, 2, axis=0)[::2]
    r = lmloss.linear_cross_entropy(every_other, w, y[::-1].copy()[::-1], grad=True)
    check(r.grad_hidden, dx, "float64", "grad_hidden")


def test_other_dlpack_arrays_come_back_in_their_kind():
    """An array of another kind that speaks DLPack: read in place, results through its
    namespace's from_dlpack (NumPy's own here, standing for any array-API library)."""

    class Foreign:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

        def __array_namespace__(self):
            return namespace

    class namespace:
        @staticmethod
        def from_dlpack(a):
            return Foreign(np.from_dlpack(a))

    rng = np.random.default_rng(17)
    z = make_logits(rng, N, V)
    y = make_labels(rng, N, V)
    loss, _, dz = loss_reference(z, y, reduction="none")
    r = lmloss.cross_entropy(Foreign(z), Foreign(y), reduction="none", grad=True)
    assert isinstance(r.loss, Foreign) and isinstance(r.grad_logits, Foreign)
    check(r.loss.a, loss, "float64", "loss")
    check(r.grad_logits.a, dz, "float64", "grad_logits")


def test_settings():
    assert lmloss.backend_available("cpu")
    assert isinstance(lmloss.backend_available("cuda"), bool)
    assert isinstance(lmloss.__version__, str)
    rng = np.random.default_rng(18)
    z = make_logits(rng, N, V)
    y = make_labels(rng, N, V)
    loss, _, _ = loss_reference(z, y)
    lmloss.set_num_threads(1)
    try:
        check(lmloss.cross_entropy(z, y).loss, loss, "float64", "loss on one thread")
    finally:
        lmloss.set_num_threads(0)
    first = lmloss.cross_entropy(z, y).loss
    assert lmloss.cross_entropy(z, y).loss == first  # deterministic run to run
    lmloss.set_product_tuning(True)  # CUDA only: the CPU result does not move
    try:
        assert lmloss.cross_entropy(z, y).loss == first
    finally:
        lmloss.set_product_tuning(False)
    lmloss.reset_peak_workspace()
    lmloss.linear_cross_entropy(*make_linear(rng, N, H, V)[:2], y, grad=True)
    assert lmloss.peak_workspace() > 0


def test_threads_each_have_their_own_context():
    """Calls from several threads at once (each thread's own context, the GIL released while the
    library works) give the single-threaded results."""

    rng = np.random.default_rng(19)
    problems = []
    for _ in range(4):
        x, w, _ = make_linear(rng, N, H, V)
        problems.append((x, w, make_labels(rng, N, V)))
    expected = [lmloss.linear_cross_entropy(x, w, y, grad=True) for x, w, y in problems]
    results = [None] * len(problems)

    def work(i):
        x, w, y = problems[i]
        for _ in range(20):
            results[i] = lmloss.linear_cross_entropy(x, w, y, grad=True)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, e in zip(results, expected):
        assert r.loss == e.loss
        np.testing.assert_array_equal(r.grad_weight, e.grad_weight)


def test_scale_gradient_extension_call():
    # The extension's lmloss_scale_gradient, which lmloss.torch uses for the gradients its fused
    # step formed: the product in float32, rounded once; here into float32 on the host, as the
    # product itself, and in place.
    rng = np.random.default_rng(7)
    grad = rng.standard_normal((37, 1003)).astype(np.float32)
    scale = np.array(0.37, dtype=np.float32)
    out = np.full_like(grad, np.nan)
    lmloss._lmloss.scale_gradient(grad=grad, scale=scale, out=out)
    np.testing.assert_array_equal(out, grad * scale)
    lmloss._lmloss.scale_gradient(grad=grad, out=out)
    np.testing.assert_array_equal(out, grad)
    lmloss._lmloss.scale_gradient(grad=grad, scale=scale, out=grad)
    np.testing.assert_array_equal(grad, out * scale)
    with pytest.raises(lmloss._lmloss.Error, match="out"):
        lmloss._lmloss.scale_gradient(grad=grad, out=np.zeros((37, 1002), np.float32))
    # A 16-bit gradient (lmloss.torch's dX of a 16-bit head), widened to float32 for the product
    # and rounded once, in place.
    half = rng.standard_normal((37, 1003)).astype(np.float16)
    want = (half.astype(np.float32) * scale).astype(np.float16)
    lmloss._lmloss.scale_gradient(grad=half, scale=scale, out=half)
    np.testing.assert_array_equal(half, want)


def test_fused_step_asks_a_maker_for_its_deferred_buffer_only_where_it_defers():
    # grad_weight_deferred may be a maker, called with the bytes the step defers: on the host the
    # step defers nothing, so the maker is never called, the call returns None, and its results
    # are the plain step's.
    rng = np.random.default_rng(11)
    x = rng.standard_normal((9, 16)).astype(np.float32)
    w = rng.standard_normal((40, 16)).astype(np.float32)
    y = rng.integers(0, 40, 9)
    options = dict(reduction="mean", ignore_index=-100, normalizer=0.0, ce_weight=1.0,
                   kd_weight=0.0, label_smoothing=0.0, z_loss=0.0, softcap=0.0, temperature=1.0)

    def step(**extra):
        out = dict(loss=np.full((), np.nan, np.float32), lse=np.full(9, np.nan, np.float32),
                   grad_hidden=np.full_like(x, np.nan), grad_weight=np.full_like(w, np.nan))
        made = lmloss._lmloss.loss("forward_backward", hidden=x, weight=w, labels=y, **options,
                                   **out, **extra)
        return made, out

    asked = []
    made, out = step(grad_weight_deferred=lambda nbytes: asked.append(nbytes))
    _, plain = step()
    assert made is None and asked == []
    for name in plain:
        np.testing.assert_array_equal(out[name], plain[name], err_msg=name)
    with pytest.raises(lmloss._lmloss.Error, match="mode"):
        lmloss._lmloss.loss("deferred_bytes", hidden=x, weight=w, labels=y, **options)


# ---- Arrays the library cannot describe in place, and the package's own checks ---------------


def test_strided_last_dimension_is_copied():
    rng = np.random.default_rng(0)
    z = make_logits(rng, 13, 2 * 257)[:, ::2]  # the last dimension's stride 2 elements
    y = make_labels(rng, 13, 257)
    loss, _, dz = loss_reference(np.ascontiguousarray(z), y)
    r = lmloss.cross_entropy(z, y, grad=True)
    assert rel_err(r.loss, loss) <= TOLERANCE["float64"]
    assert rel_err(r.grad_logits, dz) <= TOLERANCE["float64"]


def test_rows_running_backwards_are_copied():
    rng = np.random.default_rng(0)
    z, y = make_logits(rng, 13, 257), make_labels(rng, 13, 257)
    loss, _, _ = loss_reference(z[::-1].copy(), y[::-1].copy(), reduction="none")
    r = lmloss.cross_entropy(z[::-1], y[::-1], reduction="none")  # a negative row stride
    assert rel_err(r.loss, loss) <= TOLERANCE["float64"]


def test_strided_bias_is_copied():
    rng = np.random.default_rng(0)
    x, w, b = make_linear(rng, 6, 8, 17, bias=True)
    y = make_labels(rng, 6, 17)
    loss, _, _, _, db = linear_reference(x, w, b, labels=y)
    r = lmloss.linear_cross_entropy(x, w, y, bias=np.repeat(b, 2)[::2], grad=True)
    assert rel_err(r.loss, loss) <= TOLERANCE["float64"]
    assert rel_err(r.grad_bias, db) <= TOLERANCE["float64"]


def test_pinned_host_arrays_are_read_on_the_host():
    class Pinned:  # what an array in page-locked host memory says of itself: DLPack device 3
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return (3, 0)

    rng = np.random.default_rng(0)
    z, y = make_logits(rng, 6, 17), make_labels(rng, 6, 17)
    assert lmloss.cross_entropy(Pinned(z), Pinned(y)).loss == lmloss.cross_entropy(z, y).loss


def test_cross_entropy_lse_has_the_tokens_shape():
    rng = np.random.default_rng(0)
    z, y = make_logits(rng, 12, 17), make_labels(rng, 12, 17)
    assert lmloss.cross_entropy(z.reshape(3, 4, 17), y.reshape(3, 4)).lse.shape == (3, 4)


def test_sixteen_bit_logits_gradient_in_their_dtype():
    rng = np.random.default_rng(0)
    z = make_logits(rng, 6, 17).astype(np.float16)
    r = lmloss.cross_entropy(z, make_labels(rng, 6, 17), grad=True)
    assert r.grad_logits.dtype == np.float16


@pytest.mark.parametrize("vocab", [256, 257])  # the kept sum as two blocks of one size, or not
def test_sixteen_bit_weight_gradient_is_its_float32_sum_rounded(vocab):
    rng = np.random.default_rng(9)
    x, w, _ = make_linear(rng, 13, 24, vocab, "float32")
    x, w = x.astype(np.float16), w.astype(np.float16)
    y = make_labels(rng, 13, vocab)
    r16 = lmloss.linear_cross_entropy(x, w, y, grad=True)
    r32 = lmloss.linear_cross_entropy(x, w, y, grad=True, grad_weight_dtype=np.float32)
    check_rounded_once(r16.grad_weight, r32.grad_weight)


def test_sixteen_bit_weight_gradient_not_aligned_to_16_bytes(monkeypatch):
    # The library keeps half of the float32 sum over grad_weight's own bytes only where they are
    # 16-byte aligned; elsewhere the whole sum goes in the tail.
    real = lmloss._api.empty

    def unaligned(like, shape, dtype):  # 16-bit arrays 2 bytes past a 16-byte boundary
        if dtype not in ("float16", "bfloat16"):
            return real(like, shape, dtype)
        n = int(np.prod(shape))
        buf = np.empty(n + 16, dtype=dtype)
        skip = (-buf.ctypes.data % 16 + 2) // 2
        return buf[skip:skip + n].reshape(shape)

    monkeypatch.setattr(lmloss._api, "empty", unaligned)
    rng = np.random.default_rng(9)
    x, w, _ = make_linear(rng, 13, 24, 257, "float32")
    x, w = x.astype(np.float16), w.astype(np.float16)
    y = make_labels(rng, 13, 257)
    r16 = lmloss.linear_cross_entropy(x, w, y, grad=True)
    assert r16.grad_weight.ctypes.data % 16 != 0
    r32 = lmloss.linear_cross_entropy(x, w, y, grad=True, grad_weight_dtype=np.float32)
    check_rounded_once(r16.grad_weight, r32.grad_weight)


def test_extension_refuses_what_it_cannot_describe():
    # The package hands the extension clean arrays; its own checks are for other callers.
    grad = np.zeros((4, 10), np.float32)
    with pytest.raises(lmloss._lmloss.Error, match="grad: the last dimension must be contiguous"):
        lmloss._lmloss.scale_gradient(grad=grad[:, ::2], out=np.zeros((4, 5), np.float32))
    with pytest.raises(lmloss._lmloss.Error, match="grad: rows overlap"):
        lmloss._lmloss.scale_gradient(grad=np.broadcast_to(grad[0], (4, 10)), out=grad)
    read_only = np.zeros((4, 10), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(lmloss._lmloss.Error, match="out: expected a writable array"):
        lmloss._lmloss.scale_gradient(grad=grad, out=read_only)


def _in_a_fresh_thread(fn):
    """fn's value or exception, from a thread of its own: one with no lmloss context yet."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


@pytest.fixture
def settings_restored():
    """A setting made on any thread holds on every thread that made none: set the defaults back."""
    yield
    lmloss.set_workspace_budget(1 << 30)
    lmloss.set_num_threads(0)
    lmloss.set_product_tuning(False)


def test_budget_set_before_a_threads_first_call_holds(settings_restored):
    def set_then_read():
        lmloss.set_workspace_budget(1 << 20)
        return lmloss.workspace_budget()
    assert _in_a_fresh_thread(set_then_read) == {"value": 1 << 20}


def test_a_setting_holds_on_the_threads_that_made_none(settings_restored):
    """PyTorch runs backward for CUDA tensors on threads of its own: what the training thread
    set holds there too, on a thread that already has a context as on a new one. A thread's own
    setting stays its own."""
    lmloss.set_workspace_budget(3 << 20)
    assert _in_a_fresh_thread(lmloss.workspace_budget) == {"value": 3 << 20}
    ready, changed = threading.Barrier(3), threading.Event()
    seen = {}

    def worker(own):
        if own:
            lmloss.set_workspace_budget(2 << 20)
        seen[own, "before"] = lmloss.workspace_budget()  # its context made
        ready.wait()
        changed.wait()
        seen[own, "after"] = lmloss.workspace_budget()

    threads = [threading.Thread(target=worker, args=(own,)) for own in (False, True)]
    for t in threads:
        t.start()
    ready.wait()
    lmloss.set_workspace_budget(5 << 20)
    changed.set()
    for t in threads:
        t.join()
    assert seen[True, "before"] == seen[True, "after"] == 2 << 20
    assert seen[False, "after"] == 5 << 20
    assert lmloss.workspace_budget() == 5 << 20


@pytest.mark.parametrize("call,name", [(lambda: lmloss.set_workspace_budget(0), "nbytes"),
                                       (lambda: lmloss.set_num_threads(-2), "num_threads")])
def test_settings_checked_before_a_threads_first_call(call, name):
    out = _in_a_fresh_thread(call)
    assert isinstance(out.get("error"), ValueError) and str(out["error"]).startswith(name + ":")


_RELEASED_AT_EXIT = """
import atexit, numpy as np, lmloss
z = np.random.default_rng(0).standard_normal((64, 5000))
lmloss.cross_entropy(z, np.zeros(64, np.int64), grad=True)
assert lmloss.peak_workspace() > 0
atexit._run_exitfuncs()
print(lmloss.peak_workspace())
"""


def test_contexts_released_at_the_interpreters_exit():
    # While the interpreter (and PyTorch, whose allocator may have lent the workspace) still exists.
    run = subprocess.run([sys.executable, "-c", _RELEASED_AT_EXIT], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["0"]


_OUT_OF_HOST_MEMORY = """
import re, resource, numpy as np, lmloss
lmloss.set_num_threads(1)
rng = np.random.default_rng(0)
x = rng.standard_normal((4096, 64)).astype(np.float32)
w = rng.standard_normal((50000, 64)).astype(np.float32)
vm = int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (200 << 20), resource.RLIM_INFINITY))
try:
    lmloss.linear_cross_entropy(x, w, np.zeros(4096, np.int64))
except MemoryError as e:
    print("MemoryError", e)
"""


def test_host_out_of_memory_is_a_memory_error():
    # The default 1 GiB budget's workspace under an address-space limit 200 MiB above the inputs.
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("AddressSanitizer's allocator stops the process where memory runs out")
    run = subprocess.run([sys.executable, "-c", _OUT_OF_HOST_MEMORY], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "MemoryError host memory allocation failed"
