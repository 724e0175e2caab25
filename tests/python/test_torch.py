"""The PyTorch layer: gradcheck in float64 on the CPU, torch.compile(fullgraph=True), a training
step against the naive loss, and on a CUDA device bf16 parity on large shapes, PyTorch's stream
and allocator, and no host sync. Skipped, with the reason, where PyTorch or CUDA is absent."""

import contextlib
import math
import os
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import torch.nn.functional as F  # noqa: E402

import lmloss  # noqa: E402
import lmloss.torch as lt  # noqa: E402
from numpy_reference import (  # noqa: E402
    GRAD_WEIGHT_F32_OF_16_BIT,
    ROUNDED_ONCE_RATIO,
    TOLERANCE,
    rel_err,
)

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and lmloss.backend_available("cuda")),
    reason="needs a CUDA device and an lmloss built with CUDA",
)
REDUCTIONS = ["mean", "sum", "none"]


def err(out, ref) -> float:
    return rel_err(out.detach().double().cpu().numpy(), ref.detach().double().cpu().numpy())


def assert_close(out, ref, dtype, what):
    e = err(out, ref)
    assert e <= TOLERANCE[dtype], f"{what}: relative error {e:.3g} > {TOLERANCE[dtype]:g}"


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def linear_inputs(n=6, h=5, v=11, dtype=torch.float64, device="cpu", seed=0, batch=(2, 3)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) / h ** 0.5 * 2
    b = torch.randn(v, generator=g, dtype=torch.float64) * 0.3
    y = torch.randint(0, v, batch, generator=g)
    y.view(-1)[1] = -100
    cast = dict(dtype=dtype, device=device)
    return leaf(x.to(**cast)), leaf(w.to(**cast)), leaf(b.to(**cast)), y.to(device)


def naive_loss(x, w, b, y, reduction="mean", **_):
    z = x @ w.T + (0 if b is None else b)
    loss = F.cross_entropy(z.reshape(-1, z.shape[-1]).float(), y.reshape(-1), reduction=reduction)
    return loss.reshape(y.shape) if reduction == "none" else loss


# ---- gradcheck -------------------------------------------------------------------------------

OPTIONS = {
    "plain": {},
    "all": dict(label_smoothing=0.1, z_loss=1e-2, softcap=3.0, temperature=1.5, normalizer=7.0),
}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_gradcheck_linear_cross_entropy(reduction, option):
    x, w, b, y = linear_inputs()
    opts = OPTIONS[option]

    def f(x, w, b):
        return lt.linear_cross_entropy(x, w, y, bias=b, reduction=reduction, **opts)

    assert torch.autograd.gradcheck(f, (x, w, b))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck_cross_entropy(reduction):
    x, w, b, y = linear_inputs()
    z = leaf(x @ w.T)

    def f(z):
        return lt.cross_entropy(z, y, reduction=reduction, label_smoothing=0.2, softcap=4.0)

    assert torch.autograd.gradcheck(f, (z,))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck_linear_distill(reduction):
    x, w, b, y = linear_inputs()
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(11, generator=g)[:4] for _ in range(6)]).reshape(2, 3, 4)
    p = torch.rand(2, 3, 4, generator=g, dtype=torch.float64) + 0.1
    p = p / p.sum(-1, keepdim=True)
    mask = torch.tensor([[True, False, True], [True, True, False]])

    def f(x, w, b):
        return lt.linear_distill(x, w, ids, p, bias=b, labels=y, token_mask=mask, ce_weight=0.4,
                                 kd_weight=0.8, temperature=1.7, reduction=reduction)

    assert torch.autograd.gradcheck(f, (x, w, b))


# ---- Semantics -------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_matches_naive_and_honours_upstream_gradient(reduction):
    x, w, b, y = linear_inputs(dtype=torch.float64)
    loss = lt.linear_cross_entropy(x, w, y, bias=b, reduction=reduction)
    ref = naive_loss(x.double(), w.double(), b.double(), y, reduction)
    assert loss.shape == ref.shape
    assert_close(loss, ref, "float32", "loss")  # the naive loss ran in float32
    g = torch.randn_like(loss) if reduction == "none" else torch.tensor(0.37, dtype=loss.dtype)
    got = torch.autograd.grad(loss, (x, w, b), g)
    want = torch.autograd.grad(ref, (x, w, b), g.to(ref.dtype))
    for name, a, r in zip(("hidden", "weight", "bias"), got, want):
        assert a.dtype == torch.float64
        assert_close(a, r, "float32", name)


def test_gradients_only_where_wanted():
    x, w, b, y = linear_inputs()
    w.requires_grad_(False)
    loss = lt.linear_cross_entropy(x, w, y, bias=b)
    loss.backward()
    assert x.grad is not None and b.grad is not None and w.grad is None
    with torch.no_grad():
        assert lt.linear_cross_entropy(x, w, y).grad_fn is None


def test_plain_api_on_torch_tensors_returns_torch_tensors():
    x, w, b, y = linear_inputs(dtype=torch.float32)
    r = lmloss.linear_cross_entropy(x, w, y, bias=b, reduction="none", grad=True)
    assert isinstance(r.loss, torch.Tensor) and r.loss.shape == y.shape
    assert isinstance(r.grad_weight, torch.Tensor) and r.grad_weight.dtype == torch.float32
    mean = lmloss.linear_cross_entropy(x, w, y, bias=b)
    assert isinstance(mean.loss, float)
    assert abs(mean.loss - lt.linear_cross_entropy(x, w, y, bias=b).item()) < 1e-5


ARRAY_DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def bf16_head(device, seed, n=2048, h=64, v=1000):
    """(x, w, b, y) of a bf16 head, every label counted."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).bfloat16().to(device)
    w = (torch.randn(v, h, generator=g) / h ** 0.5 * 2).bfloat16().to(device)
    b = (torch.randn(v, generator=g) * 0.3).bfloat16().to(device)
    y = torch.randint(0, v, (n,), generator=g).to(device)
    return x, w, b, y


def logits_grad_f64(x, w, y, b=None):
    """softmax(z) - onehot(y) in float64: dL/dz of the summed cross-entropy."""
    z = x.double() @ w.double().T + (0 if b is None else b.double())
    p = torch.softmax(z, dim=-1)
    p[torch.arange(x.shape[0], device=x.device), y] -= 1.0
    return p


@contextlib.contextmanager
def chunks_of_256_rows(vocab):
    """A workspace budget of f32 logits chunks of at most 256 rows: 8 or more for 2048 tokens."""
    before = lmloss.workspace_budget()
    lmloss.set_workspace_budget(vocab * 4 * 256)
    try:
        yield
    finally:
        lmloss.set_workspace_budget(before)


def assert_rounded_once(ours, ref, what):
    """No further from the float64 ref than ROUNDED_ONCE_RATIO times ref rounded to bf16."""
    e, once = err(ours, ref), err(ref.bfloat16(), ref)
    assert e <= ROUNDED_ONCE_RATIO * once, \
        f"{what}: {e:.3g} against {once:.3g} for float64 rounded once"


def assert_within_an_ulp(a, b):
    """Two bf16 tensors equal but for at most 1% of elements, an ulp apart."""
    ulps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    assert ulps.max().item() <= 1 and (ulps > 0).sum().item() <= ulps.numel() // 100


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_return_lse_gives_each_tokens_log_sum_exp(reduction):
    """return_lse=True adds the log-sum-exp of each token's scaled logits (soft-capped, over the
    temperature), without gradient, beside the same loss, whose backward is unchanged; for the
    three losses."""
    x, w, b, y = linear_inputs()
    opts = dict(reduction=reduction, softcap=3.0, temperature=1.5)
    loss, lse = lt.linear_cross_entropy(x, w, y, bias=b, return_lse=True, **opts)
    s = 3.0 * torch.tanh((x @ w.T + b) / 3.0) / 1.5
    assert lse.shape == y.shape and not lse.requires_grad
    assert_close(lse, torch.logsumexp(s, -1), "float64", "lse")
    assert torch.equal(loss, lt.linear_cross_entropy(x, w, y, bias=b, **opts))
    loss.sum().backward()
    assert x.grad is not None and w.grad is not None
    _, lse_logits = lt.cross_entropy(x @ w.T + b, y, return_lse=True, **opts)
    assert_close(lse_logits, lse, "float64", "lse from logits")
    ids = y.clamp(min=0)[..., None]
    _, lse_distill = lt.linear_distill(x, w, ids, torch.ones(ids.shape, dtype=torch.float64),
                                       bias=b, return_lse=True, **opts)
    assert_close(lse_distill, lse, "float64", "lse of distillation")


@pytest.mark.parametrize("device", ARRAY_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_an_empty_batch(device, dtype, reduction):
    """No tokens: a loss of 0 (empty for "none") whose backward gives the head zero gradients,
    for cross-entropy and distillation, with a bias, in leading dimensions of no size."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(50, 16, generator=g).to(device, dtype).requires_grad_(True)
    b = torch.randn(50, generator=g).to(device, dtype).requires_grad_(True)
    x = torch.zeros(2, 0, 16, device=device, dtype=dtype, requires_grad=True)
    y = torch.zeros(2, 0, dtype=torch.int64, device=device)
    ids = torch.zeros(2, 0, 4, dtype=torch.int64, device=device)
    losses = (lt.linear_cross_entropy(x, w, y, bias=b, reduction=reduction),
              lt.linear_distill(x, w, ids, ids.float(), bias=b, reduction=reduction))
    for loss in losses:
        assert loss.shape == ((2, 0) if reduction == "none" else ())
        assert loss.dtype == torch.float32 and not loss.detach().any()
        w.grad = b.grad = x.grad = None
        loss.sum().backward()
        assert x.grad.shape == x.shape and w.grad.dtype == dtype and b.grad.dtype == dtype
        assert not w.grad.any() and not b.grad.any()


@pytest.mark.parametrize("device", ARRAY_DEVICES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_logits_masked_with_minus_infinity_as_torch(device, reduction):
    """Logits a caller masked with -inf take no probability and no gradient, as in
    F.cross_entropy; a row masked whole, its token ignored, has lse -inf, loss 0 and a zero
    gradient (PyTorch's is NaN there, so its reference row is zeros, ignored all the same)."""
    g = torch.Generator().manual_seed(11)
    n, v = 6, 37
    z = torch.randn(n, v, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    masked = torch.rand(n, v, generator=g) < 0.4
    masked[torch.arange(n), y] = False
    z[masked] = -math.inf
    z[4], y[4] = -math.inf, -100
    ours, ref = leaf(z.to(device)), leaf(z.masked_fill(torch.arange(n)[:, None] == 4, 0.0))
    loss, lse = lt.cross_entropy(ours, y.to(device), reduction=reduction, return_lse=True)
    expected = F.cross_entropy(ref, y, reduction=reduction)
    assert_close(loss, expected, "float32", "loss")
    assert lse[4].item() == -math.inf and torch.isfinite(lse[torch.arange(n) != 4]).all()
    loss.sum().backward()
    expected.sum().backward()
    assert torch.isfinite(ours.grad).all()
    assert not ours.grad.cpu()[masked].any() and not ours.grad[4].any()
    assert_close(ours.grad, ref.grad, "float32", "grad of the logits")


@pytest.mark.parametrize("device", ARRAY_DEVICES)
def test_autocast_takes_the_product_in_its_dtype(device):
    """Under torch.autocast a float32 head runs as F.linear would, in autocast's dtype: the loss
    and, cast back to float32, the gradients of the same call on bf16 copies. A bf16 hidden with
    the float32 head runs so too; outside autocast that mix is refused."""
    x, w, b, y = linear_inputs(dtype=torch.float32, device=device, batch=(4, 8), v=300, h=32)
    ids = y.clamp(min=0)[..., None]  # a teacher's top-1
    ones = torch.ones(ids.shape, dtype=torch.float32, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = lt.linear_cross_entropy(x, w, y, bias=b)
        distill = lt.linear_distill(x, w, ids, ones)
    loss.backward()
    xb, wb, bb = leaf(x.bfloat16()), leaf(w.bfloat16()), leaf(b.bfloat16())
    want = lt.linear_cross_entropy(xb, wb, y, bias=bb)
    want.backward()
    assert loss.dtype == torch.float32 and torch.equal(loss, want)
    for got, ref in ((x.grad, xb.grad), (w.grad, wb.grad), (b.grad, bb.grad)):
        assert got.dtype == torch.float32 and torch.equal(got, ref.float())
    assert torch.equal(distill, lt.linear_distill(xb, wb, ids, ones))
    with torch.autocast(device, dtype=torch.bfloat16):
        assert torch.equal(lt.linear_cross_entropy(xb.detach(), w, y, bias=b), want)
    with pytest.raises(TypeError, match="weight"):
        lt.linear_cross_entropy(xb, w, y)


@pytest.mark.parametrize("vocab", [1000, 1008])  # 1008: the gradient and the tail of one size
@pytest.mark.parametrize("device", ARRAY_DEVICES)
def test_plain_api_sums_a_bf16_weight_gradient_once(device, vocab):
    """The plain API's bf16 grad_weight and grad_bias over many chunks of tokens are their float32
    sums rounded once: no further from float64 than the float64 sums rounded to bf16 (rounded
    after each of 8 chunks of 256 rows, as CUDA's default does, they would be 2.1x further), and
    grad_weight is grad_weight_dtype=float32's result rounded, but for a rare element one ulp off
    (the two calls' sums may differ in their last bits: the CPU's chunks are smaller where the
    float32 sum takes workspace, and CUDA's products of the sum's two halves have shapes of their
    own)."""
    x, w, b, y = bf16_head(device, seed=3, v=vocab)
    with chunks_of_256_rows(w.shape[0]):
        r16 = lmloss.linear_cross_entropy(x, w, y, bias=b, grad=True)
        r32 = lmloss.linear_cross_entropy(x, w, y, bias=b, grad=True, grad_weight_dtype=torch.float32)
    assert r16.grad_weight.dtype == torch.bfloat16 and r16.grad_bias.dtype == torch.bfloat16
    assert r32.grad_weight.dtype == torch.float32 and r32.grad_bias.dtype == torch.bfloat16
    p = logits_grad_f64(x, w, y, b) / x.shape[0]
    ref_dw, ref_db = p.T @ x.double(), p.sum(0)
    assert err(r32.grad_weight, ref_dw) <= GRAD_WEIGHT_F32_OF_16_BIT
    assert_rounded_once(r16.grad_weight, ref_dw, "grad_weight")
    assert_rounded_once(r16.grad_bias, ref_db, "grad_bias")
    assert_within_an_ulp(r16.grad_weight, r32.grad_weight.bfloat16())


def test_plain_api_grad_weight_dtype_errors():
    x, w, b, y = linear_inputs(dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="grad_weight_dtype: expected one of"):
        lmloss.linear_cross_entropy(x, w, y, grad=True, grad_weight_dtype="int32")
    with pytest.raises(TypeError, match="grad_weight_dtype: expected a dtype"):
        lmloss.linear_cross_entropy(x, w, y, grad=True, grad_weight_dtype=object())
    with pytest.raises(TypeError, match="grad_weight"):  # the library's: bfloat16 or float32
        lmloss.linear_cross_entropy(x, w, y, grad=True, grad_weight_dtype=torch.float16)
    r = lmloss.linear_distill(x, w, torch.arange(2).expand(*y.shape, 2),
                              torch.full((*y.shape, 2), 0.5), grad=True, grad_weight_dtype="float32")
    assert r.grad_weight.dtype == torch.float32 and r.grad_hidden.dtype == torch.bfloat16


@pytest.mark.parametrize("device", ARRAY_DEVICES)
def test_bf16_weight_gradient_is_its_f32_sum_rounded_once(device, monkeypatch):
    """A bf16 head's weight gradient is summed in float32 over its own bytes and a tail and
    rounded once in backward, times the upstream gradient: within an ulp, in at most 1% of
    elements, of the float32-tensor path (_KEEP_WEIGHT_SUM off) rounded once, and within
    ROUNDED_ONCE_RATIO of float64 rounded once; so too on reduction "none"'s recomputing
    backward."""
    x, w, _, y = bf16_head(device, seed=4)
    monkeypatch.setattr(lt, "_KEEP_WEIGHT_RESTS", False)  # the float32 sum where the pair would run

    def weight_grad(keep, reduction):
        monkeypatch.setattr(lt, "_KEEP_WEIGHT_SUM", keep)
        xg, wg = leaf(x), leaf(w)
        loss = lt.linear_cross_entropy(xg, wg, y, reduction=reduction)
        (loss * 0.75).sum().backward()
        return wg.grad

    with chunks_of_256_rows(w.shape[0]):
        kept, wide = weight_grad(True, "mean"), weight_grad(False, "mean")
        per_token = weight_grad(True, "none")
    assert kept.dtype == torch.bfloat16 and kept.shape == w.shape and kept.is_contiguous()
    assert_within_an_ulp(kept, wide)
    ref = 0.75 * (logits_grad_f64(x, w, y).T @ x.double())
    assert_rounded_once(kept, ref / x.shape[0], "mean")
    assert_rounded_once(per_token, ref, "none")


@pytest.mark.parametrize("device", ARRAY_DEVICES)
def test_bf16_weight_sum_kept_as_values_and_rests(device, monkeypatch):
    """With _KEEP_WEIGHT_RESTS a bf16 head's weight gradient holds its sum's bf16 values and a
    uint8 tail of their 8-bit rests (3 bytes an entry): rounded in backward, times the upstream
    gradient, it is the float32 sum rounded once but for at most 2% of elements (0.6% here over 8
    chunks: values whose chunks cancel, the pair's error being relative to the running sum; the
    sum's bf16 values alone, rounded each chunk, would differ in most), and within
    ROUNDED_ONCE_RATIO of float64 rounded once; so too on reduction "none"'s recomputing
    backward, and with a bias."""
    x, w, b, y = bf16_head(device, seed=6)
    tails = []  # the tails the roundings were given
    real_round = lmloss._api.invoke_round_grad_weight

    def recording_round(device, **kwargs):
        tails.append((kwargs["tail"].dtype, tuple(kwargs["tail"].shape)))
        return real_round(device, **kwargs)
    monkeypatch.setattr(lmloss._api, "invoke_round_grad_weight", recording_round)

    def weight_grad(rests, reduction, bias=None):
        monkeypatch.setattr(lt, "_KEEP_WEIGHT_RESTS", rests)
        xg, wg = leaf(x), leaf(w)
        loss = lt.linear_cross_entropy(xg, wg, y, bias=bias, reduction=reduction)
        (loss * 0.75).sum().backward()
        return wg.grad

    with chunks_of_256_rows(w.shape[0]):
        pair, f32_sum = weight_grad(True, "mean"), weight_grad(False, "mean")
        per_token = weight_grad(True, "none")
        with_bias = weight_grad(True, "mean", leaf(b))
    assert tails[0] == (torch.uint8, tuple(w.shape)) and tails[1][0] == torch.float32
    assert tails[2:] == [tails[0]] * 2
    assert pair.dtype == torch.bfloat16 and pair.shape == w.shape and pair.is_contiguous()
    differ = (pair != f32_sum).float().mean().item()
    assert differ <= 0.02, f"{differ:.3g} of dW differs from the float32 sum rounded once"
    ref = 0.75 * (logits_grad_f64(x, w, y).T @ x.double())
    assert_rounded_once(pair, ref / x.shape[0], "mean")
    assert_rounded_once(per_token, ref, "none")
    ref_bias = 0.75 * (logits_grad_f64(x, w, y, b).T @ x.double()) / x.shape[0]
    assert_rounded_once(with_bias, ref_bias, "with a bias")


def test_weight_sum_rests_spend_the_bytes_they_save_on_workspace(monkeypatch):
    # The pair's tail takes a byte an entry where the float32 sum's takes ~2: its calls (the fused
    # step, the recomputing backward) add the difference to the budget, and other calls nothing.
    # On the CPU the pair is taken only where asked (its products there go through float32).
    x, w, b, y = linear_inputs(dtype=torch.bfloat16, v=304, h=16)
    assert not lt._keeps_rests(w) and not lt._keeps_rests(w.float())
    calls = _library_calls(monkeypatch)
    saved = lmloss._api.weight_sum_tail_rows(304) * 16 * 4 - 304 * 16
    for rests in (True, False):
        monkeypatch.setattr(lt, "_KEEP_WEIGHT_RESTS", rests)
        for reduction in ("mean", "none"):
            calls.clear()
            lt.linear_cross_entropy(leaf(x), leaf(w), y, reduction=reduction).sum().backward()
            mode, kwargs = calls[-1]
            assert mode == ("forward_backward" if reduction == "mean" else "backward")
            assert kwargs["grad_weight_sum_tail"].dtype == (torch.uint8 if rests else torch.float32)
            assert kwargs["extra_workspace"] == (saved if rests else 0), (rests, reduction)
    calls.clear()
    lt.linear_cross_entropy(leaf(x.float()), leaf(w.float()), y).backward()
    assert calls[-1][1]["extra_workspace"] == 0


def test_bf16_weight_gradient_accumulates_over_micro_batches():
    # The first backward's gradient (rounded in place over its own sum) becomes weight.grad, and
    # the second's is added to it: the gradient of both micro-batches.
    x, w, b, y = linear_inputs(dtype=torch.bfloat16, batch=(4, 16), v=300, h=16)
    lt.linear_cross_entropy(x[:2], w, y[:2]).backward()
    lt.linear_cross_entropy(x[2:], w, y[2:]).backward()
    xr, wr = leaf(x), leaf(w)
    (naive_loss(xr[:2], wr, None, y[:2]) + naive_loss(xr[2:], wr, None, y[2:])).backward()
    assert w.grad.dtype == torch.bfloat16
    assert_close(w.grad, wr.grad, "bfloat16", "weight gradient over two micro-batches")


def test_second_backward_through_a_16_bit_head_is_refused():
    # The first backward rounds the float32 sum in place; a second cannot take it again and says so.
    x, w, b, y = linear_inputs(dtype=torch.bfloat16)
    loss = lt.linear_cross_entropy(x, w, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
    x, w, b, y = linear_inputs(dtype=torch.float32)  # a float32 head's gradient is not rounded
    loss = lt.linear_cross_entropy(x, w, y)
    loss.backward(retain_graph=True)
    first = w.grad.clone()
    loss.backward()
    assert torch.allclose(w.grad, 2 * first)


def test_modules():
    x, w, b, y = linear_inputs()
    module = lt.LinearCrossEntropyLoss(reduction="sum", label_smoothing=0.1)
    assert torch.equal(module(x, w, y, b),
                       lt.linear_cross_entropy(x, w, y, bias=b, reduction="sum",
                                               label_smoothing=0.1))
    ids = torch.randint(0, 11, (2, 3, 2))
    p = torch.full((2, 3, 2), 0.5, dtype=torch.float32)  # cast to the compute dtype inside
    kd = lt.LinearDistillLoss(ce_weight=0.5, kd_weight=0.5)
    assert torch.equal(kd(x, w, ids, p, labels=y),
                       lt.linear_distill(x, w, ids, p.double(), labels=y, ce_weight=0.5,
                                         kd_weight=0.5))
    assert "label_smoothing=0.1" in repr(module)


def test_bad_arguments_name_the_argument():
    x, w, b, y = linear_inputs()
    bad = y.clone()
    bad[0, 0] = 99
    with pytest.raises(ValueError, match="^labels:"):
        lt.linear_cross_entropy(x, w, bad)
    with pytest.raises(ValueError, match="^labels:"):
        lt.linear_cross_entropy(x, w, y[:1])
    with pytest.raises(ValueError, match="^reduction:"):
        lt.LinearCrossEntropyLoss(reduction="avg")
    with pytest.raises(TypeError, match="^weight:"):
        lt.linear_cross_entropy(x, w.float(), y)


def test_fused_backward_makes_no_zero_gradients():
    # The fused op's outputs besides the loss (lse, the gradients it returns) receive no gradient;
    # left to autograd's default, backward would make zero tensors of their sizes (for a 16-bit
    # head's float32 dW, 2 GiB at V 128256 and H 4096).
    from torch.profiler import ProfilerActivity, profile
    x, w, b, y = linear_inputs(dtype=torch.float32, batch=(4, 8), v=300, h=16)
    loss = lt.linear_cross_entropy(x, w, y, bias=b) * 0.5
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, acc_events=True) as prof:
        loss.backward()
    zeroed = [e.input_shapes for e in prof.events() if e.name in ("aten::zero_", "aten::fill_")]
    assert not any([list(w.shape)] == shapes[:1] for shapes in zeroed), zeroed
    assert w.grad is not None and x.grad is not None and b.grad is not None


# ---- torch.compile ---------------------------------------------------------------------------


@pytest.mark.parametrize("reduction,dtype", [("mean", torch.float32), ("none", torch.float32),
                                             ("mean", torch.bfloat16)])
def test_compile_fullgraph(reduction, dtype):
    # bfloat16: the weight's kept float32 sum and the float32 bias gradient are scaled and
    # rounded by the library's custom ops inside the traced backward.
    x, w, b, y = linear_inputs(dtype=dtype, v=300, h=16)
    torch._dynamo.reset()

    def step(x, w, b, y):
        loss = lt.linear_cross_entropy(x, w, y, bias=b, reduction=reduction, z_loss=1e-3)
        return loss.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(x, w, b, y)
    grads = torch.autograd.grad(loss, (x, w, b))
    x2, w2, b2 = leaf(x), leaf(w), leaf(b)
    ref = step(x2, w2, b2, y)
    ref_grads = torch.autograd.grad(ref, (x2, w2, b2))
    assert_close(loss, ref, "float32", "loss")
    for a, r in zip(grads, ref_grads):
        assert_close(a, r, "float32", "gradient")


def test_compile_inductor_bf16_head_matches_eager():
    # A bf16 head's weight gradient is rounded in backward by a custom op that writes the tensor
    # saved from forward; Inductor runs it in place. The same calls as eagerly: the same bits.
    x, w, b, y = linear_inputs(dtype=torch.bfloat16, v=300, h=16)
    torch._dynamo.reset()

    def step(x, w, y):
        return lt.linear_cross_entropy(x, w, y) * 0.75

    compiled = torch.compile(step, fullgraph=True)
    compiled(x, w, y).backward()
    x2, w2 = leaf(x), leaf(w)
    step(x2, w2, y).backward()
    assert w.grad.dtype == torch.bfloat16
    assert torch.equal(w.grad, w2.grad) and torch.equal(x.grad, x2.grad)


# ---- A training step -------------------------------------------------------------------------


class TinyLM(torch.nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def hidden(self, tokens):
        return torch.tanh(self.mix(self.embed(tokens)))


def training_step(model, tokens, labels, fused):
    model.zero_grad()
    h = model.hidden(tokens)
    if fused:
        loss = lt.LinearCrossEntropyLoss()(h, model.head.weight, labels)
    else:
        logits = model.head(h)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def check_training_step(device, dtype, vocab, hidden, batch, seq, tolerance):
    torch.manual_seed(0)
    model = TinyLM(vocab, hidden).to(device=device, dtype=dtype)
    tokens = torch.randint(0, vocab, (batch, seq), device=device)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    loss, grads = training_step(model, tokens, labels, fused=True)
    ref_loss, ref_grads = training_step(model, tokens, labels, fused=False)
    assert_close(loss, ref_loss, tolerance, "loss")
    for name in grads:
        assert grads[name].dtype == dtype
        assert_close(grads[name], ref_grads[name], tolerance, name)


def test_training_step_cpu():
    check_training_step("cpu", torch.float64, vocab=97, hidden=16, batch=3, seq=10,
                        tolerance="float64")


@needs_cuda
def test_training_step_cuda_bf16():
    check_training_step("cuda", torch.bfloat16, vocab=32000, hidden=512, batch=4, seq=256,
                        tolerance="bfloat16")


# ---- CUDA ------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("shape", [(8192, 2048, 128256), (4096, 2304, 256000)])
def test_bf16_parity_large(shape):
    n, h, v = shape
    torch.manual_seed(0)
    x = torch.randn(n, h, device="cuda").bfloat16().requires_grad_(True)
    w = (torch.randn(v, h, device="cuda") / h ** 0.5 * 2).bfloat16().requires_grad_(True)
    y = torch.randint(0, v, (n,), device="cuda")
    y[::7] = -100
    loss = lt.linear_cross_entropy(x, w, y)
    dx, dw = torch.autograd.grad(loss, (x, w))
    # The reference: the same bf16 inputs, in float32.
    x32, w32 = leaf(x.float()), leaf(w.float())
    ref = F.cross_entropy(x32 @ w32.T, y)
    rdx, rdw = torch.autograd.grad(ref, (x32, w32))
    del x32, w32
    # The naive loss in bf16, for scale.
    xb, wb = leaf(x), leaf(w)
    naive = F.cross_entropy(xb @ wb.T, y)
    ndx, ndw = torch.autograd.grad(naive, (xb, wb))
    for what, ours, bf16, r in (("loss", loss, naive, ref), ("grad_hidden", dx, ndx, rdx),
                                ("grad_weight", dw, ndw, rdw)):
        e, e_naive = err(ours, r), err(bf16, r)
        print(f"{shape} {what}: lmloss {e:.3g}, naive bf16 {e_naive:.3g}")
        assert e <= TOLERANCE["bfloat16"], f"{what}: {e:.3g} (naive bf16 {e_naive:.3g})"


@needs_cuda
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cuda_eager_step_defers_its_last_weight_product(smoothing, monkeypatch):
    # A bf16 weight's kept sum over several token chunks: the eager step leaves its last chunk's
    # dW product to backward, which stores it over the sum with the upstream gradient (0.37 here)
    # as the scale. The gradient is the one the step gives without deferring, rounded once from
    # (nearly) the same float32 sum, and meets the float32 reference.
    sizes = []  # of the buffers the extension asked for
    maker = lmloss._api.deferred_maker

    def recording_maker(like):
        make = maker(like)
        return lambda nbytes: sizes.append(nbytes) or make(nbytes)
    monkeypatch.setattr(lmloss._api, "deferred_maker", recording_maker)
    monkeypatch.setattr(lt, "_KEEP_WEIGHT_RESTS", False)  # the float32 sum's deferral
    torch.manual_seed(3)
    n, h, v = 2000, 256, 4000
    x = torch.randn(n, h, device="cuda").bfloat16()
    w = (torch.randn(v, h, device="cuda") / h ** 0.5 * 2).bfloat16()
    y = torch.randint(0, v, (n,), device="cuda")
    y[::9] = -100

    def grads(defer):
        monkeypatch.setattr(lt, "_DEFER_WEIGHT_PRODUCT", defer)
        xs, ws = leaf(x), leaf(w)
        (lt.linear_cross_entropy(xs, ws, y, label_smoothing=smoothing) * 0.37).backward()
        return xs.grad, ws.grad

    before = lmloss.workspace_budget()
    lmloss.set_workspace_budget(v * 2 * 600)  # about 600 tokens a chunk
    try:
        dx, dw = grads(True)
        assert sizes and sizes[-1] > 0, "the step deferred nothing"
        dx_plain, dw_plain = grads(False)
    finally:
        lmloss.set_workspace_budget(before)
    assert torch.equal(dx, dx_plain)
    differ = (dw != dw_plain).float().mean().item()
    assert differ <= 0.01, f"{differ:.3g} of dW differs from the step that adds every product"
    x32, w32 = leaf(x.float()), leaf(w.float())
    ref = F.cross_entropy(x32 @ w32.T, y, label_smoothing=smoothing) * 0.37
    rdx, rdw = torch.autograd.grad(ref, (x32, w32))
    assert_close(dx, rdx, "bfloat16", "grad_hidden")
    assert_close(dw, rdw, "bfloat16", "grad_weight")
    # The array functions defer too, rounding right after their step.
    calls = len(sizes)
    lmloss.set_workspace_budget(v * 2 * 600)
    try:
        r = lmloss.linear_cross_entropy(x, w, y, label_smoothing=smoothing, grad=True)
    finally:
        lmloss.set_workspace_budget(before)
    assert len(sizes) == calls + 1 and sizes[-1] > 0
    assert_close(r.grad_weight, rdw / 0.37, "bfloat16", "array grad_weight")


@needs_cuda
def test_cuda_runs_on_the_current_stream_without_host_sync():
    x, w, b, y = linear_inputs(dtype=torch.float32, device="cuda", batch=(64, 32), v=5000, h=64)
    with torch.no_grad():  # no graph of the default stream's kept alive for the side stream's backward
        expected = lt.linear_cross_entropy(x, w, y, bias=b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda.set_sync_debug_mode("error")  # any host sync PyTorch sees raises
        try:
            late = torch.empty_like(x)
            torch.cuda._sleep(50_000_000)
            with torch.no_grad():
                late.copy_(x)  # ready only on this stream, after the sleep
            late.requires_grad_(True)
            loss = lt.linear_cross_entropy(late, w, y, bias=b)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.current_stream().wait_stream(side)
    assert loss.device.type == "cuda"
    assert_close(loss, expected, "float32", "loss on a side stream")
    lmloss.synchronize()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_backward_on_another_thread_keeps_the_budget_set_for_the_step(device):
    """PyTorch runs backward for CUDA tensors on a thread of its own, where reduction "none" forms
    the logits again: the budget set on the training thread bounds it there too. On the CPU,
    backward called from a fresh thread stands in for that thread. The budget and the peak are
    read by hooks, which run on the thread that runs lmloss's backward: the loss's before it,
    the hidden states' after."""
    x, w, b, y = linear_inputs(dtype=torch.float32, device=device, batch=(256,), v=4000, h=64)
    budget = 256 << 10  # a sixteenth of the f32 logits
    index = -1 if device == "cpu" else torch.cuda.current_device()
    seen = {}

    def before(grad):
        seen["thread"] = threading.get_ident()
        lmloss.reset_peak_workspace(index)
        return grad

    def after(grad):
        seen["same thread"] = seen["thread"] == threading.get_ident()
        seen["budget"] = lmloss.workspace_budget()
        seen["peak"] = lmloss.peak_workspace(index)
        return grad

    lmloss.set_workspace_budget(budget)
    try:
        loss = lt.linear_cross_entropy(x, w, y, bias=b, reduction="none")
        loss.register_hook(before)
        x.register_hook(after)
        def backward():
            try:
                loss.sum().backward()
            except Exception as e:  # noqa: BLE001 - reported below, on the test's thread
                seen["error"] = e

        t = threading.Thread(target=backward)
        t.start()
        t.join()
    finally:
        lmloss.set_workspace_budget(1 << 30)
    assert "error" not in seen and seen.get("same thread") and seen["budget"] == budget, seen
    assert 0 < seen["peak"] <= budget, seen
    assert x.grad is not None and w.grad is not None


@needs_cuda
def test_cuda_workspace_comes_from_torch_allocator():
    x, w, b, y = linear_inputs(dtype=torch.float32, device="cuda", batch=(256, 16), v=50257, h=128)
    seen = {}

    def run():  # a fresh thread: a fresh lmloss context, so nothing is cached yet
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lmloss.reset_peak_workspace(0)
        with torch.no_grad():
            lt.linear_cross_entropy(x, w, y, bias=b)
        torch.cuda.synchronize()
        seen["torch_peak"] = torch.cuda.max_memory_allocated() - base
        seen["workspace"] = lmloss.peak_workspace(0)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["workspace"] > 0
    assert seen["torch_peak"] >= seen["workspace"], seen


@needs_cuda
@pytest.mark.parametrize("keep", [True, False])
def test_cuda_weight_gradient_cast_without_a_full_size_temporary(keep, monkeypatch):
    # Kept as its float32 sum over its own bytes and a tail, a 16-bit head's dW is rounded in
    # place: backward adds no dW-sized tensor at all (the limit below is half of one). In a float32
    # tensor of its own (a traced graph's way), backward rounds it to the parameter's dtype once,
    # in slices, and makes no zero gradients for the op's other outputs, so beside the saved
    # float32 gradient it adds little more than the result: 32 MiB here (a full-size float32
    # temporary, or a zero dW, would add 64 MiB more; 96.5 MiB measured before both).
    monkeypatch.setattr(lt, "_KEEP_WEIGHT_SUM", keep)
    monkeypatch.setattr(lt, "_CAST_SLICE_BYTES", 4 << 20)
    x, w, b, y = linear_inputs(dtype=torch.bfloat16, device="cuda", batch=(4, 64), v=32768, h=512)
    loss = lt.linear_cross_entropy(x, w, y) * 0.5  # an upstream gradient that is not 1
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    limit = w.numel() if keep else w.numel() * 2 + (16 << 20)
    assert extra < limit, f"backward allocated {extra / 2**20:.1f} MiB"
    xr, wr = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    (naive_loss(xr, wr, None, y) * 0.5).backward()
    assert w.grad.dtype == torch.bfloat16
    assert_close(w.grad, wr.grad, "bfloat16", "weight gradient")
    assert_close(x.grad, xr.grad, "bfloat16", "hidden gradient")


def weight_sum_tail_lies_above(device, vocab, hidden, array_api=False):
    """Checks the buffers lmloss.torch (or, with array_api, the array functions on tensors) takes
    for a 16-bit weight's kept sum over a vocabulary of a multiple of 16: the tail at or past the
    gradient's end (one f32 matrix, or one product batched over both parts, never two)."""
    w = torch.empty(vocab, hidden, dtype=torch.bfloat16, device=device)
    if array_api:
        g_weight, tail = lmloss._api._weight_sum_buffers(lmloss._api.as_array(w, "w"), w.shape,
                                                         "bfloat16")
    else:
        g_weight, tail = lt._weight_sum_buffers(w)
    assert g_weight.dtype == torch.bfloat16 and g_weight.shape == w.shape
    assert tail.dtype == torch.float32 and tail.shape == (vocab // 2, hidden)
    assert g_weight.is_contiguous() and tail.is_contiguous()
    assert tail.data_ptr() >= g_weight.data_ptr() + g_weight.nbytes


@pytest.mark.parametrize("array_api", [False, True])
def test_weight_sum_tail_lies_above_the_gradient(monkeypatch, array_api):
    # An allocator that hands out each block below the one before, as a caching allocator may.
    arena = torch.empty(1 << 22, dtype=torch.uint8)
    top = [arena.numel()]

    def top_down(shape, dtype):
        size = math.prod(shape) * dtype.itemsize
        top[0] -= (size + 511) // 512 * 512
        t = torch.empty(0, dtype=dtype)
        return t.set_(arena.untyped_storage(), top[0] // dtype.itemsize, tuple(shape),
                      (shape[1], 1) if len(shape) == 2 else (1,))

    monkeypatch.setattr(lmloss._api, "empty",
                        lambda like, shape, dtype: top_down(shape, getattr(torch, dtype)))
    weight_sum_tail_lies_above("cpu", 4096, 40, array_api)


@needs_cuda
def test_cuda_weight_sum_tail_lies_above_the_gradient_in_a_used_allocator(monkeypatch):
    # A cached block between one and two gradients in size (4 MiB each: the allocator's large
    # blocks) takes the first of the two blocks asked for, the given-back one the second: the
    # lower of them becomes the gradient. (The float32 sum's placement, where the pair would run.)
    monkeypatch.setattr(lt, "_KEEP_WEIGHT_RESTS", False)
    for array_api in (False, True):
        spare = torch.empty(6 << 20, dtype=torch.uint8, device="cuda")
        del spare
        weight_sum_tail_lies_above("cuda", 32768, 64, array_api)


def test_weight_sum_placed_together_only_where_the_allocator_splits_its_block(monkeypatch):
    place = lmloss._api.weight_sum_placed_together
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert place(32768, True) and not place(32760, True) and not place(32768, False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:512")
    assert not place(32768, True)


# In a process of its own: its caching allocator holds no free block but those the step gives back.
_PLACEMENT = """
import sys, torch, lmloss, lmloss.torch as lt
vocab = int(sys.argv[1])
lt._KEEP_WEIGHT_RESTS = False  # the float32 sum's placement, where the pair would run
w = torch.empty(vocab, 512, dtype=torch.bfloat16, device="cuda")
g_weight, tail = lt._weight_sum_buffers(w)
assert g_weight.dtype == torch.bfloat16 and g_weight.shape == w.shape
assert tail.shape == (lmloss._api.weight_sum_tail_rows(vocab), 512) and tail.dtype == torch.float32
print(tail.data_ptr() == g_weight.data_ptr() + g_weight.nbytes,
      lmloss._api.weight_sum_placed_together(vocab, True))
"""


@needs_cuda
@pytest.mark.parametrize("vocab", [32768, 32760])
def test_cuda_weight_sum_is_one_matrix_where_the_vocabulary_allows(vocab):
    # The tail placed where the gradient's bytes end (one product a chunk); else apart (two). The
    # caching allocator takes the smallest free block that fits (best fit), so this holds only
    # where it has no other: in a fresh process, not always in a long one (docs/python.md).
    conf = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    env = {k: v for k, v in os.environ.items() if k not in conf}
    run = subprocess.run([sys.executable, "-c", _PLACEMENT, str(vocab)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    adjacent, asked_together = run.stdout.split()[-2:]
    assert adjacent == asked_together == str(vocab % 16 == 0)


# Steps on the main thread and on one of its own, then the process exits. On CUDA, backward calls
# the library from PyTorch's autograd thread, whose contexts are torn down only as the process
# ends (after the interpreter): they are left to the exit then (a teardown there may meet a CUDA
# runtime already gone).
_STEPS_THEN_EXIT = """
import sys, threading, torch, lmloss.torch as lt
device = sys.argv[1]
def step():
    x = torch.randn(64, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
    w = torch.randn(1000, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
    y = torch.randint(0, 1000, (64,), device=device)
    lt.linear_cross_entropy(x, w, y).backward()
    assert bool(torch.isfinite(w.grad.float()).all()) and x.grad is not None
step()
worker = threading.Thread(target=step)
worker.start()
worker.join()
print("stepped")
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_process_exits_cleanly_after_steps(device):
    for _ in range(3 if device == "cuda" else 1):
        run = subprocess.run([sys.executable, "-c", _STEPS_THEN_EXIT, device],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and run.stdout.split()[-1:] == ["stepped"], (
            run.returncode, run.stderr[-2000:])


@needs_cuda
def test_cuda_compile_inductor_and_bad_label_flag():
    x, w, b, y = linear_inputs(dtype=torch.bfloat16, device="cuda", batch=(8, 128), v=4096, h=256)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, y: lt.linear_cross_entropy(x, w, y), fullgraph=True)
    loss = compiled(x, w, y)
    loss.backward()
    assert_close(loss, naive_loss(x, w, None, y), "bfloat16", "compiled loss")
    bad = y.clone()
    bad[0, 0] = 4096 + 3
    with torch.no_grad():
        lt.linear_cross_entropy(x, w, bad)  # queued: the device finds the id, no sync here
    with pytest.raises(ValueError):
        lmloss.synchronize()
    lmloss.synchronize()  # the flag was cleared by the report


def eager_step(x, w, y):
    """(loss, x.grad, w.grad) of one eager step of the fused loss on copies of x and w."""
    x, w = leaf(x), leaf(w)
    loss = lt.linear_cross_entropy(x, w, y)
    loss.backward()
    return loss.detach(), x.grad, w.grad


def assert_same_step(got, want):
    """Loss and dX bitwise; dW, rounded once from its float32 sum, within an ulp (the sum's two
    halves may lie apart in one run and together in the other: one product a chunk or two)."""
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert_within_an_ulp(got[2], want[2])


@needs_cuda
def test_cuda_graph_replays_the_step_on_new_inputs():
    """A bf16 head's step (its weight gradient kept as a float32 sum and rounded in backward)
    captured with torch.cuda.graph after warm-up steps on a side stream, as PyTorch asks: each
    replay gives what an eager step on the static tensors' contents gives."""
    x0, w0, _, y0 = bf16_head("cuda", seed=11, n=512, h=256, v=4096)
    x1, w1, _, y1 = bf16_head("cuda", seed=12, n=512, h=256, v=4096)
    want0, want1 = eager_step(x0, w0, y0), eager_step(x1, w1, y1)
    x, w, y = leaf(x0), leaf(w0), y0.clone()

    def step():
        x.grad = w.grad = None
        loss = lt.linear_cross_entropy(x, w, y)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = lt.linear_cross_entropy(x, w, y)
        loss.backward()
    for inputs, want in (((x1, w1, y1), want1), ((x0, w0, y0), want0), ((x1, w1, y1), want1)):
        with torch.no_grad():
            x.copy_(inputs[0])
            w.copy_(inputs[1])
            y.copy_(inputs[2])
        graph.replay()
        torch.cuda.synchronize()
        assert_same_step((loss.detach(), x.grad, w.grad), want)


@needs_cuda
def test_cuda_compiled_with_cuda_graphs():
    """torch.compile(mode="reduce-overhead") takes the loss's forward and backward into CUDA
    graphs (none skipped) and, once they replay, gives the eager steps' results."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x, w, y: lt.linear_cross_entropy(x, w, y),
                             mode="reduce-overhead", fullgraph=True)
    for seed in range(4):  # warm-up, recording, then replays
        x0, w0, _, y0 = bf16_head("cuda", seed=20 + seed, n=512, h=256, v=4096)
        x, w = leaf(x0), leaf(w0)
        loss = compiled(x, w, y0)
        loss.backward()
        got = (loss.detach().clone(), x.grad.clone(), w.grad.clone())
        assert_same_step(got, eager_step(x0, w0, y0))
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_fsdp_head_is_taken_inside_its_module():
    """Under FSDP2 the head's weight is a sharded DTensor outside its module's forward: given it,
    the loss raises a TypeError that says where to call it; called inside that forward (where FSDP
    gathers the weight) it gives the plain head's loss and gradients. One process, gloo."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("PyTorch without torch.distributed")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    from torch.distributed.device_mesh import init_device_mesh

    class Head(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = torch.nn.Parameter(weight.clone())

        def forward(self, hidden, labels):
            return lt.linear_cross_entropy(hidden, self.weight, labels)

    x, w, _, y = linear_inputs(dtype=torch.float32)
    want = lt.linear_cross_entropy(x, w, y)
    want.backward()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        head = Head(w.detach())
        fsdp.fully_shard(head, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(TypeError, match="weight: a DTensor"):
            lt.linear_cross_entropy(x, head.weight, y)
        with pytest.raises(TypeError, match="weight: a DTensor"):
            lmloss.linear_cross_entropy(x.detach(), head.weight, y)
        xs = leaf(x)
        loss = head(xs, y)
        loss.backward()
        assert torch.equal(loss, want) and torch.equal(xs.grad, x.grad)
        assert torch.equal(head.weight.grad.full_tensor(), w.grad)
    finally:
        dist.destroy_process_group()


def test_the_training_example_learns():
    """examples/torch_training.py (the docs point to it) runs and its loss falls below half."""
    import pathlib
    import runpy

    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "torch_training.py"
    assert runpy.run_path(str(example))["main"](steps=60) < 0.5


# ---- What the autograd layer passes on: views, options, modes ---------------------------------


def test_strided_views_give_what_their_copies_give():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(13, 2 * 257, generator=g, dtype=torch.float64)[:, ::2]  # last stride 2
    y = torch.randint(0, 257, (13,), generator=g)
    r = lmloss.cross_entropy(z, y, grad=True)
    ref = lmloss.cross_entropy(z.contiguous(), y, grad=True)
    assert r.loss == ref.loss and torch.equal(r.grad_logits, ref.grad_logits)
    x, _, _, y = linear_inputs()
    w = torch.randn(11, 10, dtype=torch.float64)[:, ::2].requires_grad_(True)  # last stride 2
    w2 = leaf(w.detach().contiguous())
    loss, want = lt.linear_cross_entropy(x, w, y), lt.linear_cross_entropy(x.detach(), w2, y)
    assert torch.equal(loss, want)
    loss.backward()
    want.backward()
    assert torch.equal(w.grad, w2.grad)
    ids = torch.arange(2).expand(2, 3, 2)  # rows of stride 0 once the batch is folded
    p = torch.full((2, 3, 2), 0.5, dtype=torch.float64)
    assert torch.equal(lt.linear_distill(x, w2, ids, p),
                       lt.linear_distill(x, w2, ids.contiguous(), p))


def test_bf16_logits_gradient_in_their_dtype():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 50, generator=g).bfloat16()
    y = torch.randint(0, 50, (6,), generator=g)
    assert lmloss.cross_entropy(z, y, grad=True).grad_logits.dtype == torch.bfloat16


def test_synchronize_without_cuda_returns(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_device():
        raise AssertionError("asked for a CUDA device")

    monkeypatch.setattr(torch.cuda, "current_device", no_device)
    lmloss.synchronize()
    lmloss.synchronize(torch.device("cpu"))


def test_weight_gradient_in_float32_without_the_kept_sum():
    x, w, _, _ = linear_inputs(dtype=torch.bfloat16)
    buffers = lt._grad_buffers(None, x.reshape(-1, 5), w, None, False, True, True, False,
                               keep_weight_sum=False)
    assert buffers[2].dtype == torch.float32 and buffers[4].numel() == 0


# The kept float32 sum as two blocks of one size, or not; the sum as values and rests.
@pytest.mark.parametrize("vocab,rests", [(300, False), (304, False), (300, True)])
def test_compiled_bf16_head_matches_eager(vocab, rests, monkeypatch):
    monkeypatch.setattr(lt, "_KEEP_WEIGHT_RESTS", rests)
    x, w, b, y = linear_inputs(dtype=torch.bfloat16, v=vocab, h=16)
    torch._dynamo.reset()

    def step(x, w, y):
        return lt.linear_cross_entropy(x, w, y) * 0.75

    torch.compile(step, fullgraph=True, backend="aot_eager")(x, w, y).backward()
    x2, w2 = leaf(x), leaf(w)
    step(x2, w2, y).backward()
    assert torch.equal(w.grad, w2.grad) and torch.equal(x.grad, x2.grad)


def _library_calls(monkeypatch):
    calls, real = [], lt._run

    def spy(mode, device, **kwargs):
        calls.append((mode, kwargs))
        return real(mode, device, **kwargs)

    monkeypatch.setattr(lt, "_run", spy)
    return calls


def test_recomputing_backward_skips_a_weight_that_needs_no_gradient(monkeypatch):
    x, w, b, y = linear_inputs()
    w.requires_grad_(False)
    calls = _library_calls(monkeypatch)
    lt.linear_cross_entropy(x, w, y, bias=b, reduction="none").sum().backward()
    mode, kwargs = calls[-1]
    assert mode == "backward" and kwargs["grad_weight"] is None
    assert kwargs["grad_hidden"] is not None


def test_no_gradient_work_under_no_grad(monkeypatch):
    x, w, b, y = linear_inputs()
    calls = _library_calls(monkeypatch)
    with torch.no_grad():
        lt.linear_cross_entropy(x, w, y, bias=b)
    assert [mode for mode, _ in calls] == ["forward"]


def test_create_graph_gradients_are_differentiable_in_the_upstream_gradient():
    # d/ds of the gradient for upstream s is the gradient for upstream 1: each gradient (a 16-bit
    # weight's kept sum, a float64 hidden state's, a bf16 head's bias through sliced casts).
    x, w, _, y = linear_inputs(dtype=torch.bfloat16, v=48, h=8)
    x = x.detach()
    unit, = torch.autograd.grad(lt.linear_cross_entropy(x, w, y), w)
    s = torch.tensor(0.37, requires_grad=True)
    gw, = torch.autograd.grad(lt.linear_cross_entropy(x, w, y), w, s, create_graph=True)
    r = torch.randn(w.shape, generator=torch.Generator().manual_seed(1))
    ds, = torch.autograd.grad((gw.float() * r).sum(), s)
    assert torch.allclose(ds, (unit.float() * r).sum(), rtol=1e-2)

    x, w, b, y = linear_inputs(dtype=torch.float64)
    s = torch.tensor(0.37, dtype=torch.float64, requires_grad=True)
    gx, = torch.autograd.grad(lt.linear_cross_entropy(x, w, y, bias=b), x, s, create_graph=True)
    r = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ds, = torch.autograd.grad((gx * r).sum(), s)
    assert torch.allclose(ds, (gx * r).sum() / 0.37)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_second_order_gradients_are_refused(reduction):
    # A gradient penalty: d/dw of |dL/dx|^2 needs dL/dx differentiated in w, which lmloss does not
    # form. Refused with lmloss's message, not given without that term.
    x, w, b, y = linear_inputs()
    loss = lt.linear_cross_entropy(x, w, y, bias=b, reduction=reduction).sum()
    with pytest.raises(RuntimeError, match="second-order gradients are not implemented"):
        gx, = torch.autograd.grad(loss, x, create_graph=True)
        torch.autograd.grad((gx ** 2).sum(), w)


def test_float16_gradients_take_the_loss_scale_before_rounding():
    # A float16 step under a loss scale (GradScaler's 65536): dX and the logits' gradient, of
    # order 1 / N, would round into float16's subnormals if formed for an upstream of 1 and scaled
    # afterwards (N 16384: 5.7e-3 and 4.5e-3 against float64 that way). Formed in float32 or with
    # the scale inside, each is rounded once: at float16's own rounding of the exact gradient.
    g = torch.Generator().manual_seed(0)
    n, h, v, scale = 16384, 32, 256, 65536.0
    x = leaf((torch.randn(n, h, generator=g) * 0.5).half())
    w = leaf((torch.randn(v, h, generator=g) * 0.05).half())
    y = torch.randint(0, v, (n,), generator=g)
    (lt.linear_cross_entropy(x, w, y) * scale).backward()
    x64, w64 = leaf(x.double()), leaf(w.double())
    (F.cross_entropy(x64 @ w64.T, y) * scale).backward()
    floor = err(x64.grad.half(), x64.grad)
    assert err(x.grad, x64.grad) < 1.2 * floor
    assert err(w.grad, w64.grad) < 1.2 * err(w64.grad.half(), w64.grad)

    z = leaf((x64 @ w64.T).detach().half())
    (lt.cross_entropy(z, y) * scale).backward()
    z64 = leaf(z.double())
    (F.cross_entropy(z64, y) * scale).backward()
    assert err(z.grad, z64.grad) < 1.2 * err(z64.grad.half(), z64.grad)


@pytest.mark.parametrize("case,exception,name", [
    ("numpy weight", TypeError, "weight"), ("3-D weight", ValueError, "weight"),
    ("list bias", TypeError, "bias"), ("no labels", TypeError, "labels"),
    ("no teacher_probs", TypeError, "teacher_probs"), ("list token_mask", TypeError, "token_mask"),
])
def test_arguments_that_are_not_tensors_are_named(case, exception, name):
    x, w, b, y = linear_inputs()
    ids = torch.zeros(*y.shape, 2, dtype=torch.long)
    p = torch.full(ids.shape, 0.5, dtype=torch.float64)
    call = {
        "numpy weight": lambda: lt.linear_cross_entropy(x, w.detach().numpy(), y),
        "3-D weight": lambda: lt.linear_cross_entropy(x, w[None], y),
        "list bias": lambda: lt.linear_cross_entropy(x, w, y, bias=b.tolist()),
        "no labels": lambda: lt.linear_cross_entropy(x, w, None),
        "no teacher_probs": lambda: lt.linear_distill(x, w, ids, None),
        "list token_mask": lambda: lt.linear_distill(x, w, ids, p, token_mask=[1] * 6),
    }[case]
    with pytest.raises(exception, match=f"^{name}:"):
        call()


def test_create_graph_bias_gradient_of_a_bf16_head(monkeypatch):
    monkeypatch.setattr(lt, "_CAST_SLICE_BYTES", 64)
    x, w, b, y = linear_inputs(dtype=torch.bfloat16, v=300, h=8)
    s = torch.tensor(0.5, requires_grad=True)
    gb, = torch.autograd.grad(lt.linear_cross_entropy(x, w, y, bias=b), b, s, create_graph=True)
    b2 = leaf(b)
    want, = torch.autograd.grad(lt.linear_cross_entropy(x, w, y, bias=b2) * 0.5, b2)
    assert torch.equal(gb, want)


def test_fused_backward_casts_no_weight_sized_tensor(monkeypatch):
    # Without the kept sum the float32 dW is scaled and rounded once, by the library: PyTorch
    # makes no full-size copy of it.
    from torch.profiler import ProfilerActivity, profile
    monkeypatch.setattr(lt, "_KEEP_WEIGHT_SUM", False)
    x, w, b, y = linear_inputs(dtype=torch.bfloat16, v=300, h=16)
    loss = lt.linear_cross_entropy(x, w, y, bias=b) * 0.5
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss.backward()
    casts = [e.input_shapes for e in prof.events() if e.name in ("aten::_to_copy", "aten::to")]
    assert not any(shapes[:1] == [[300, 16]] for shapes in casts), casts


def test_autocast_leaves_a_float64_head_alone():
    x, w, b, y = linear_inputs(dtype=torch.float64)
    want = lt.linear_cross_entropy(x, w, y, bias=b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = lt.linear_cross_entropy(x, w, y, bias=b)
    assert got.dtype == torch.float64 and torch.equal(got, want)


def test_distillation_counts_only_tokens_in_the_mask():
    x, w, b, y = linear_inputs()
    ids = y.clamp(min=0)[..., None]
    p = torch.ones(ids.shape, dtype=torch.float64)
    mask = torch.tensor([[True, False, True], [False, True, True]])
    loss = lt.linear_distill(x, w, ids, p, token_mask=mask, reduction="none")
    assert not loss[~mask].any() and loss[mask].all()
    want = lmloss.linear_distill(x.detach(), w.detach(), ids, p, token_mask=mask)
    assert lt.linear_distill(x, w, ids, p, token_mask=mask).item() == want.loss


def test_modules_pass_every_option():
    x, w, b, y = linear_inputs()
    y = y.clone()
    y[y == -100] = 3
    y[0, 0] = 3  # ignored under ignore_index 3
    opts = dict(ignore_index=3, label_smoothing=0.1, z_loss=1e-2, softcap=3.0, temperature=1.5)
    for reduction in ("mean", "none"):
        module = lt.LinearCrossEntropyLoss(reduction=reduction, **opts)
        assert torch.equal(module(x, w, y, b, normalizer=7.0),
                           lt.linear_cross_entropy(x, w, y, bias=b, reduction=reduction,
                                                   normalizer=7.0, **opts))
    ids = torch.randint(0, 11, (2, 3, 2), generator=torch.Generator().manual_seed(3))
    p = torch.tensor([0.7, 0.3], dtype=torch.float64).expand(2, 3, 2)
    kd = lt.LinearDistillLoss(ce_weight=0.3, kd_weight=0.9, reduction="sum", **opts)
    assert torch.equal(kd(x, w, ids, p, labels=y, bias=b),
                       lt.linear_distill(x, w, ids, p, labels=y, bias=b, ce_weight=0.3,
                                         kd_weight=0.9, reduction="sum", **opts))


def test_scalar_teacher_ids_are_refused_by_name():
    x, w, _, _ = linear_inputs()
    with pytest.raises(ValueError, match="^teacher_ids:"):
        lt.linear_distill(x[0, 0], w, torch.tensor(3), torch.tensor(1.0, dtype=torch.float64))
