"""The array API: losses and teacher top-k on NumPy arrays, PyTorch tensors or any DLPack array.

Each function checks what only Python knows (leading batch dimensions, the kind of the options),
allocates its outputs as the caller's kind of array on the inputs' device, and hands everything
to the library in place. The library checks the rest before it writes anything, so a failed
call leaves every input, and an in-place gradient's logits, as they were.
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from . import _lmloss
from ._arrays import FLOAT_DTYPES, Array, as_array, empty, float32_over, to_float

_REDUCTIONS = ("mean", "sum", "none")
_SIXTEEN_BIT = ("bfloat16", "float16")


@dataclass
class LossResult:
    """What a loss returns. `loss` is a Python float for reduction "mean" and "sum" and an array
    of the tokens' shape for "none"; `lse` holds log-sum-exp of the scaled logits per token. The
    gradients are set with grad=True: `grad_logits` for cross_entropy (the logits themselves with
    inplace_grad=True), `grad_hidden`, `grad_weight` (None with grad_weight=False) and `grad_bias`
    (None without a bias) for the linear losses."""

    loss: Any
    lse: Any
    grad_hidden: Any = None
    grad_weight: Any = None
    grad_bias: Any = None
    grad_logits: Any = None


@dataclass
class TopkResult:
    """ids (int32, [..., k]) sorted by descending logit, ties to the lower id; probs ([..., k],
    float32, float64 for float64 inputs); tail ([...], the probability mass outside the k; zeros
    when renormalised)."""

    ids: Any
    probs: Any
    tail: Any


# ---- Errors ----------------------------------------------------------------------------------

# The library names arguments as its C structs do ("head.hidden", "options.temperature"); the
# Python functions take them as plain keywords.
_C_PREFIX = re.compile(r"\b(?:head|targets|options|grads)\.")


def _translate(error: _lmloss.Error) -> Exception:
    status, message = error.args
    message = _C_PREFIX.sub("", message)
    if status in ("invalid_argument", "unsupported") and "dtype" in message:
        return TypeError(message)
    if status in ("invalid_argument", "id_out_of_range"):
        return ValueError(message)
    if status == "unsupported":
        return NotImplementedError(message)
    if status == "out_of_memory":
        return MemoryError(message)
    return RuntimeError(message)


# ---- Option parsing --------------------------------------------------------------------------


def _real(value, name: str) -> float:
    if isinstance(value, (bool, str, bytes)) or not hasattr(type(value), "__float__"):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    return float(value)


_INT64 = (-(1 << 63), (1 << 63) - 1)


def _integer(value, name: str, bounds=_INT64) -> int:
    """value as an int within bounds (the C type's range, so that the module's own conversion
    never refuses it with a signature dump instead of the argument's name)."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an integer, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}") from None
    low, high = bounds
    if not low <= value <= high:
        raise ValueError(f"{name}: {value} is outside [{low}, {high}]")
    return value


def _reduction(value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"reduction: expected a string, got {type(value).__name__}")
    if value not in _REDUCTIONS:
        raise ValueError(f'reduction: expected "mean", "sum" or "none", got "{value}"')
    return value


def _positive_or_none(value, name: str, none_means: str) -> float:
    """A finite positive number, or None for the library's 0 ("off")."""
    if value is None:
        return 0.0
    x = _real(value, name)
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"{name}: must be finite and > 0 (None {none_means}), got {x}")
    return x


def _softcap(value) -> float:
    return _positive_or_none(value, "softcap", "turns soft-capping off")


def _normalizer(value) -> float:
    return _positive_or_none(value, "normalizer", "divides by the counted tokens")


def loss_options(*, reduction, ignore_index, label_smoothing, z_loss, softcap, temperature,
                 normalizer, ce_weight=1.0, kd_weight=0.0) -> dict:
    """The library's loss options from the Python keywords, checked for kind (the library
    checks the ranges)."""
    return dict(
        reduction=_reduction(reduction),
        ignore_index=_integer(ignore_index, "ignore_index"),
        normalizer=_normalizer(normalizer),
        ce_weight=_real(ce_weight, "ce_weight"),
        kd_weight=_real(kd_weight, "kd_weight"),
        label_smoothing=_real(label_smoothing, "label_smoothing"),
        z_loss=_real(z_loss, "z_loss"),
        softcap=_softcap(softcap),
        temperature=_real(temperature, "temperature"),
    )


# ---- Running on the arrays' device -----------------------------------------------------------


def _torch_alloc(nbytes, device, stream):
    return sys.modules["torch"].cuda.caching_allocator_alloc(nbytes, device, stream)


def _torch_free(address, nbytes, device, stream):
    sys.modules["torch"].cuda.caching_allocator_delete(address)


_TORCH_ALLOCATOR = (_torch_alloc, _torch_free)


def device_stream(device: int):
    """(stream, allocator) for a call on `device` (-1: the host). On CUDA, with PyTorch loaded,
    work goes on PyTorch's current stream and workspace comes from its caching allocator;
    otherwise on the legacy default stream with the library's own allocator."""
    if device < 0:
        return 0, None
    torch = sys.modules.get("torch")
    if torch is None:
        return 0, None
    return torch.cuda.current_stream(device).cuda_stream, _TORCH_ALLOCATOR


def _on_device(device: int):
    """PyTorch exports a CUDA tensor through DLPack only while its device is the current one."""
    torch = sys.modules.get("torch")
    if device < 0 or torch is None:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _invoke(call, device: int, *args, **kwargs):
    """An extension call on `device` with its stream and allocator; library errors translated."""
    stream, allocator = device_stream(device)
    try:
        with _on_device(device):
            return call(*args, stream=stream, allocator=allocator, **kwargs)
    except _lmloss.Error as e:
        raise _translate(e) from None


def invoke_loss(mode: str, device: int, **kwargs):
    """A loss call; for a fused step whose grad_weight_deferred is a maker (deferred_maker), the
    buffer it made, or None where the step defers nothing."""
    return _invoke(_lmloss.loss, device, mode, **kwargs)


def deferred_maker(like):
    """What a fused step that may defer its last dW product takes as grad_weight_deferred: the
    extension calls it with the bytes the step defers (lmloss_loss_deferred_bytes), where it
    defers any, for a byte tensor on like's CUDA device, held until the rounding."""
    torch = sys.modules["torch"]
    return lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, device=like.device)


def invoke_topk(device: int, **kwargs) -> None:
    _invoke(_lmloss.topk, device, **kwargs)


def invoke_scale_gradient(device: int, **kwargs) -> None:
    _invoke(_lmloss.scale_gradient, device, **kwargs)


def invoke_round_grad_weight(device: int, **kwargs) -> None:
    _invoke(_lmloss.round_grad_weight, device, **kwargs)


def synchronize(device=None) -> None:
    """Waits for this thread's lmloss work on a CUDA device and raises ValueError if a label or
    teacher id was found out of range there since the last check. `device`: a CUDA ordinal, a
    torch.device, or None for the current PyTorch device (the host: returns at once)."""
    if device is None:
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available():
            return
        device = torch.cuda.current_device()
    elif not isinstance(device, int):
        if getattr(device, "type", None) == "cpu":
            return
        device = device.index if device.index is not None else sys.modules["torch"].cuda.current_device()
    stream, _ = device_stream(device)
    try:
        _lmloss.synchronize(device, stream)
    except _lmloss.Error as e:
        raise _translate(e) from None


# ---- Shapes ----------------------------------------------------------------------------------


def _lead(x, name: str) -> Array:
    a = as_array(x, name)
    if a.ndim < 1:
        last = "hidden" if name == "hidden" else "vocab"
        raise ValueError(f"{name}: expected shape (..., {last}), got a scalar")
    return a


def _batched(x, name: str, batch: tuple, lead_name: str, extra: Optional[str] = None,
             optional: bool = False) -> Optional[Array]:
    """A per-token argument: shape `batch` (labels, mask) or `batch + (k,)` (teacher top-k)."""
    if x is None:
        if optional:
            return None
        raise TypeError(f"{name}: is required")
    a = as_array(x, name)
    shape = a.shape
    ok = (len(shape) >= 1 and shape[:-1] == batch) if extra else shape == batch
    if not ok:
        want = f"{batch + ('k',)}" if extra else f"{batch}"
        raise ValueError(
            f"{name}: expected shape {want.replace(chr(39), '')} to match the leading dimensions "
            f"of {lead_name}, got {shape}"
        )
    return a


def _matrix(x, name: str, meaning: str) -> Array:
    a = as_array(x, name)
    if a.ndim != 2:
        raise ValueError(f"{name}: expected shape {meaning}, got {a.shape}")
    return a


def _compute_dtype(lead: Array) -> str:
    return "float64" if lead.dtype == "float64" else "float32"


def _finish_loss(lead: Array, loss, reduction: str, batch: tuple):
    """The loss as the caller sees it: a float for mean/sum (reading it waits for a CUDA
    device, which also reports ids found out of range there), an array of the tokens' shape
    for none."""
    if reduction == "none":
        return lead.back(loss.reshape(batch))
    if lead.device >= 0:
        synchronize(lead.device)
    return to_float(loss, lead.kind)


# ---- The losses ------------------------------------------------------------------------------


def cross_entropy(logits, labels, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                  z_loss=0.0, softcap=None, temperature=1.0, normalizer=None, grad=False,
                  inplace_grad=False) -> LossResult:
    """Cross-entropy of logits [..., V] against labels [...] (class dimension last).

    grad=True also returns grad_logits, the gradient of the loss (of the sum of the per-token
    losses for reduction "none"); inplace_grad=True writes it over the logits (and implies
    grad=True), which must then be a writable array whose leading dimensions fold into rows
    without a copy."""
    z = _lead(logits, "logits")
    batch = z.shape[:-1]
    y = _batched(labels, "labels", batch, "logits")
    opts = loss_options(reduction=reduction, ignore_index=ignore_index,
                        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                        temperature=temperature, normalizer=normalizer)
    inplace = bool(inplace_grad)
    grad = bool(grad) or inplace
    z_rows = _inplace_rows(z) if inplace else z.rows()
    n = z_rows.shape[0]
    compute = _compute_dtype(z)
    loss = empty(z, (n,) if opts["reduction"] == "none" else (), compute)
    lse = empty(z, (n,), compute)
    grad_logits = None
    if grad:
        grad_logits = z_rows if inplace else empty(z, tuple(z_rows.shape), z.dtype)
    invoke_loss("forward_backward" if grad else "forward", z.device, logits=z_rows,
                labels=y.flat(), loss=loss, lse=lse, grad_logits=grad_logits, **opts)
    result = LossResult(loss=_finish_loss(z, loss, opts["reduction"], batch),
                        lse=z.back(lse.reshape(batch)))
    if grad:
        result.grad_logits = logits if inplace else z.back(grad_logits.reshape(z.shape))
    return result


def _inplace_rows(z: Array):
    """The logits as rows that alias the caller's memory, or ValueError naming them."""
    v = z.shape[-1]
    if z.kind == "numpy":
        if not z.data.flags.writeable:
            raise ValueError("logits: is read-only; inplace_grad needs a writable array")
        rows = z.data.reshape(math.prod(z.shape[:-1]), v)
        if rows.size and not np.may_share_memory(rows, z.data):
            rows = None
    else:
        try:
            rows = z.data.view(-1, v)
        except RuntimeError:
            rows = None
    if rows is not None:
        from ._arrays import _describable

        if _describable(rows, z.kind) is not rows:
            rows = None
    if rows is None:
        raise ValueError(
            "logits: inplace_grad needs logits whose leading dimensions fold into rows with a "
            "contiguous last dimension, without a copy"
        )
    return rows


def _linear_head(hidden, weight, bias):
    x = _lead(hidden, "hidden")
    w = _matrix(weight, "weight", "(vocab, hidden)")
    b = None if bias is None else as_array(bias, "bias")
    return x, w, b


def _bias_rows(b: Optional[Array]):
    if b is None:
        return None
    return b.flat() if b.ndim == 1 else b.data


def _grad_weight_dtype(value, x: Array) -> str:
    """The dtype grad_weight is returned in: hidden's by default, else one given as a string, a
    NumPy dtype or a torch.dtype (the library says which it takes: hidden's or float32)."""
    if value is None:
        return x.dtype
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype):
        name = str(value).replace("torch.", "")
    elif isinstance(value, str) and value in FLOAT_DTYPES:
        name = value
    else:
        try:
            name = np.dtype(value).name
        except TypeError:
            raise TypeError(f"grad_weight_dtype: expected a dtype, got {value!r}") from None
    if name not in FLOAT_DTYPES:
        raise TypeError(f"grad_weight_dtype: expected one of {', '.join(FLOAT_DTYPES)}, got {name}")
    if name == "bfloat16" and x.kind == "numpy":
        raise TypeError("grad_weight_dtype: bfloat16 takes PyTorch tensors (NumPy has none of its "
                        "own to return)")
    return name


def _data_address(a) -> int:
    return a.data_ptr() if hasattr(a, "data_ptr") else a.__array_interface__["data"][0]


def weight_sum_tail_rows(vocab: int) -> int:
    """LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS: the rows of a 16-bit grad_weight's kept float32 sum
    beyond the half its own bytes hold."""
    return vocab - vocab // 16 * 8


def weight_sum_placed_together(vocab: int, on_cuda: bool) -> bool:
    """Whether a 16-bit grad_weight and its kept sum's tail are asked of PyTorch's caching
    allocator right after one block of both sizes is given back to it, so that the tail lands where
    the gradient's bytes end (the sum then one float32 matrix: one product a chunk). Only on CUDA,
    for a vocabulary of a multiple of 16 (the two halves equal), and not with max_split_size_mb
    set: the allocator then keeps such a block whole for requests of its size and would map two
    new ones instead."""
    if not on_cuda or 2 * weight_sum_tail_rows(vocab) != vocab:
        return False
    names = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    return not any("max_split_size" in os.environ.get(name, "") for name in names)


def _weight_sum_buffers(x: Array, shape, dtype: str):
    """A 16-bit grad_weight and the float32 tail of its kept sum (the library's
    grad_weight_sum_tail): the sum is summed over the gradient's own bytes (its first half of rows,
    when they are 16-byte aligned) and the tail, and rounded once into the gradient after the
    call. For PyTorch tensors over a vocabulary of a multiple of 16 the two are of one size: two
    such blocks are taken and the lower becomes the gradient, so that the tail lies right after it
    or above it (one product a token chunk, whole or batched over both parts), never below (two).
    On CUDA they are asked of PyTorch's caching allocator right after one block of both sizes is
    given back, which places the tail where the gradient's bytes end: the sum is then one float32
    matrix (see weight_sum_placed_together)."""
    vocab, hidden = shape
    least = weight_sum_tail_rows(vocab)
    if weight_sum_placed_together(vocab, x.device >= 0):
        empty(x, (vocab * hidden,), "float32")  # given back at once
    if 2 * least == vocab and x.kind == "torch":
        g_weight, above = sorted((empty(x, shape, dtype) for _ in range(2)), key=_data_address)
        return g_weight, float32_over(above, (least, hidden))
    g_weight = empty(x, shape, dtype)
    tail_rows = least if _data_address(g_weight) % 16 == 0 else vocab
    return g_weight, empty(x, (tail_rows, hidden), "float32")


def _linear_grads(x: Array, w: Array, b: Optional[Array], n: int, grad: bool,
                  grad_weight: bool, weight_dtype: str) -> dict:
    """The gradient arrays the library writes. A 16-bit grad_weight is summed in float32 and
    rounded once (see _weight_sum_buffers; on CUDA it would be rounded after each chunk of tokens
    otherwise), as the library always sums a grad_bias."""
    if not grad:
        return {}
    g_weight = tail = None
    if grad_weight and weight_dtype in _SIXTEEN_BIT:
        g_weight, tail = _weight_sum_buffers(x, w.shape, weight_dtype)
    elif grad_weight:
        g_weight = empty(x, w.shape, weight_dtype)
    return dict(
        grad_hidden=empty(x, (n, x.shape[-1]), x.dtype),
        grad_weight=g_weight,
        grad_bias=empty(x, (w.shape[0],), x.dtype) if b is not None else None,
        grad_weight_sum_tail=tail,
    )


def _invoke_linear(x: Array, grad, grads: dict, **arrays) -> None:
    """A linear loss call, then a 16-bit grad_weight's kept float32 sum rounded once into it; on
    a GPU the step's last dW product left to that rounding where the library defers it
    (lmloss_loss_deferred_bytes: no product into the sum and no rounding pass of its own)."""
    tail = grads.get("grad_weight_sum_tail")
    maker = deferred_maker(x.data) if tail is not None and x.device >= 0 else None
    deferred = invoke_loss("forward_backward" if grad else "forward", x.device,
                           grad_weight_deferred=maker, **arrays, **grads)
    if tail is not None:
        invoke_round_grad_weight(x.device, grad_weight=grads["grad_weight"], tail=tail, scale=None,
                                 deferred=deferred)


def _linear_result(x: Array, loss, lse, grads: dict, reduction: str, batch: tuple) -> LossResult:
    result = LossResult(loss=_finish_loss(x, loss, reduction, batch), lse=x.back(lse.reshape(batch)))
    if grads:
        result.grad_hidden = x.back(grads["grad_hidden"].reshape(x.shape))
        result.grad_weight = None if grads["grad_weight"] is None else x.back(grads["grad_weight"])
        result.grad_bias = None if grads["grad_bias"] is None else x.back(grads["grad_bias"])
    return result


def _linear_outputs(x, w, b, opts, grad, grad_weight, grad_weight_dtype):
    """The rows of hidden, and the loss, lse and gradient arrays a linear loss writes."""
    x_rows = x.rows()
    n = x_rows.shape[0]
    compute = _compute_dtype(x)
    loss = empty(x, (n,) if opts["reduction"] == "none" else (), compute)
    lse = empty(x, (n,), compute)
    grads = _linear_grads(x, w, b, n, bool(grad), bool(grad_weight),
                          _grad_weight_dtype(grad_weight_dtype, x))
    return x_rows, loss, lse, grads


def linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index=-100,
                         reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None,
                         temperature=1.0, normalizer=None, grad=False,
                         grad_weight=True, grad_weight_dtype=None) -> LossResult:
    """Cross-entropy of the logits hidden @ weight.T (+ bias), formed a chunk of tokens at a
    time and never held whole. hidden [..., H], weight [V, H] (nn.Linear layout), labels [...].

    grad=True also returns grad_hidden, grad_weight (skipped with grad_weight=False) and
    grad_bias: gradients of the loss (of the sum of the per-token losses for "none").
    grad_weight comes in hidden's dtype, or in grad_weight_dtype (float32 for a 16-bit head:
    the fastest on CUDA, and unrounded). A 16-bit grad_weight is summed in float32 and rounded
    once: half of that sum over the gradient's own bytes and half in a float32 array of about
    vocab / 2 x hidden held during the call."""
    x, w, b = _linear_head(hidden, weight, bias)
    batch = x.shape[:-1]
    y = _batched(labels, "labels", batch, "hidden")
    opts = loss_options(reduction=reduction, ignore_index=ignore_index,
                        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                        temperature=temperature, normalizer=normalizer)
    x_rows, loss, lse, grads = _linear_outputs(x, w, b, opts, grad, grad_weight, grad_weight_dtype)
    _invoke_linear(x, grad, grads, hidden=x_rows, weight=w.rows(), bias=_bias_rows(b),
                   labels=y.flat(), loss=loss, lse=lse, **opts)
    return _linear_result(x, loss, lse, grads, opts["reduction"], batch)


def linear_distill(hidden, weight, teacher_ids, teacher_probs, *, bias=None, labels=None,
                   token_mask=None, ce_weight=0.0, kd_weight=1.0, ignore_index=-100,
                   label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0,
                   reduction="mean", normalizer=None, grad=False,
                   grad_weight=True, grad_weight_dtype=None) -> LossResult:
    """Top-k distillation through the head: per token, kd_weight * KL(teacher top-k || student)
    + ce_weight * cross-entropy against labels (+ z-loss), in one pass over the logits.

    teacher_ids [..., k] (int32/int64) and teacher_probs [..., k] (float32; float64 with float64
    inputs) hold the teacher's top-k; labels [...] and token_mask [...] (bool/uint8, False = not
    counted) say which tokens count. grad, grad_weight and grad_weight_dtype: as in
    linear_cross_entropy."""
    x, w, b = _linear_head(hidden, weight, bias)
    batch = x.shape[:-1]
    ids = _batched(teacher_ids, "teacher_ids", batch, "hidden", extra="k")
    probs = _batched(teacher_probs, "teacher_probs", batch, "hidden", extra="k")
    y = _batched(labels, "labels", batch, "hidden", optional=True)
    mask = _batched(token_mask, "token_mask", batch, "hidden", optional=True)
    opts = loss_options(reduction=reduction, ignore_index=ignore_index,
                        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                        temperature=temperature, normalizer=normalizer, ce_weight=ce_weight,
                        kd_weight=kd_weight)
    x_rows, loss, lse, grads = _linear_outputs(x, w, b, opts, grad, grad_weight, grad_weight_dtype)
    if probs.shape != ids.shape:
        raise ValueError(f"teacher_probs: expected shape {ids.shape} like teacher_ids, got {probs.shape}")
    _invoke_linear(x, grad, grads, hidden=x_rows, weight=w.rows(), bias=_bias_rows(b),
                   labels=None if y is None else y.flat(), teacher_ids=ids.rows(),
                   teacher_probs=probs.rows(), token_mask=None if mask is None else mask.flat(),
                   loss=loss, lse=lse, **opts)
    return _linear_result(x, loss, lse, grads, opts["reduction"], batch)


# ---- Teacher top-k ---------------------------------------------------------------------------


def _topk(head: dict, lead: Array, vocab: int, k, softcap, temperature, renormalize) -> TopkResult:
    k = _integer(k, "k")
    if not 1 <= k <= vocab:
        raise ValueError(f"k: {k} must be in [1, vocab = {vocab}]")
    batch = lead.shape[:-1]
    rows = head["logits"] if head.get("logits") is not None else head["hidden"]
    n = rows.shape[0]
    compute = _compute_dtype(lead)
    ids = empty(lead, (n, k), "int32")
    probs = empty(lead, (n, k), compute)
    tail = empty(lead, (n,), compute)
    invoke_topk(lead.device, **head, k=k, softcap=_softcap(softcap),
                temperature=_real(temperature, "temperature"), renormalize=bool(renormalize),
                ids=ids, probs=probs, tail=tail)
    return TopkResult(ids=lead.back(ids.reshape(batch + (k,))),
                      probs=lead.back(probs.reshape(batch + (k,))),
                      tail=lead.back(tail.reshape(batch)))


def topk(hidden, weight, k, *, bias=None, softcap=None, temperature=1.0,
         renormalize=True) -> TopkResult:
    """The teacher's top-k through its head (hidden [..., H], weight [V, H]), without its full
    logits. renormalize=True: probs are the softmax over the k selected (tail 0); False: the
    full-vocabulary probabilities of those ids, with the mass outside them in tail."""
    x, w, b = _linear_head(hidden, weight, bias)
    head = dict(hidden=x.rows(), weight=w.rows(), bias=_bias_rows(b))
    return _topk(head, x, w.shape[0], k, softcap, temperature, renormalize)


def topk_logits(logits, k, *, softcap=None, temperature=1.0, renormalize=True) -> TopkResult:
    """As topk, from logits [..., V]."""
    z = _lead(logits, "logits")
    return _topk(dict(logits=z.rows()), z, z.shape[-1], k, softcap, temperature, renormalize)


# ---- Settings ----------------------------------------------------------------------------------
# Each holds for the calling thread and for every thread that has made no setting of that kind
# itself, so PyTorch's autograd threads (where backward runs for CUDA tensors) follow the training
# thread; a thread that sets its own keeps it.


def set_workspace_budget(nbytes: int) -> None:
    """Bounds the library's own working memory (logits chunks, scratch) on every device, for this
    thread and the threads that set none (see above). Default 1 GiB."""
    try:
        _lmloss.set_workspace_budget(_integer(nbytes, "nbytes", (1, (1 << 64) - 1)))
    except _lmloss.Error as e:
        raise _translate(e) from None


def workspace_budget() -> int:
    return _lmloss.workspace_budget()


def peak_workspace(device: int = -1) -> int:
    """The most workspace bytes this thread's calls held at once on `device` (-1: the host)."""
    return _lmloss.peak_workspace(device)


def reset_peak_workspace(device: int = -1) -> None:
    _lmloss.reset_peak_workspace(device)


def set_product_tuning(enabled: bool) -> None:
    """CUDA: time cuBLASLt's candidate algorithms for each product shape on its first call and
    keep the fastest (off by default). That first call synchronises the device and costs up to
    ~30 times the product; later calls are as fast as the choice. Results stay bitwise the same
    from call to call of a thread, but another process may choose, and round, differently."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    _lmloss.set_product_tuning(enabled)


def set_num_threads(num_threads: int) -> None:
    """CPU threads for the calls of this thread and of the threads that set none; 0: all cores."""
    try:
        _lmloss.set_num_threads(_integer(num_threads, "num_threads", (0, (1 << 31) - 1)))
    except _lmloss.Error as e:
        raise _translate(e) from None


def backend_available(device: str) -> bool:
    """Whether the "cpu" or "cuda" backend is built in and has a usable device."""
    try:
        return _lmloss.backend_available(device)
    except _lmloss.Error as e:
        raise _translate(e) from None
