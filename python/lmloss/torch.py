"""lmloss for PyTorch: autograd-aware losses and nn.Module wrappers.

    import lmloss.torch as lt
    loss = lt.linear_cross_entropy(hidden, model.lm_head.weight, labels)   # hidden [B, T, H]
    loss.backward()                                                        # grads to hidden, weight

Under torch.autocast the head's product takes autocast's dtype, as F.linear's would.

The losses are torch.library custom ops with fake implementations, so torch.compile
(fullgraph=True) traces them without a graph break; called eagerly, the same functions run
through torch.autograd.Function, without the custom ops' Python dispatch. They run on the tensors'
device: on CUDA on PyTorch's current stream, with workspace from its caching allocator, and
without a device-to-host sync (the loss stays a device tensor).

Gradients: with reduction "mean" or "sum" and a gradient needed, one fused pass computes the loss
and the gradients together (each chunk of logits is formed once, 6NHV flops); backward scales
them by the upstream gradient. With reduction "none" the upstream gradient is a per-token vector
known only in backward, so forward saves log-sum-exp and backward recomputes the logits a chunk at
a time (8NHV flops). For bf16/f16 weights the weight and bias gradients are accumulated in float32
and cast to the parameter's dtype once; the weight's float32 sum is held over the bytes of the
gradient it becomes (and a tail) and rounded there, in place, so a second backward through the
same loss (retain_graph=True) raises (under torch.compile, PyTorch's check of the buffers a
compiled backward reuses raises). On an H100 or H200 a bf16 weight's sum is held instead as its
bf16 values and an 8-bit rest of each (3 bytes an entry against 4, within ~1e-5 of the float32
sum), and the step spends the byte an entry this saves on workspace beyond the budget
(lmloss.set_workspace_budget): larger token chunks, in the memory the float32 sum would take.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

try:
    import torch
except ImportError as e:
    raise ImportError("lmloss.torch needs PyTorch: pip install torch (or lmloss[torch]); the "
                      "NumPy functions are in lmloss itself") from e
from torch import Tensor

from . import _api
from ._arrays import as_array, check_not_sharded

__all__ = [
    "cross_entropy",
    "linear_cross_entropy",
    "linear_distill",
    "LinearCrossEntropyLoss",
    "LinearDistillLoss",
]

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Gradients summed over every token (weight, bias) are kept in float32 for 16-bit inputs."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def _rows(t: Optional[Tensor]) -> Optional[Tensor]:
    """t when the library can describe it in place (unit last stride, rows not overlapping)."""
    if t is None:
        return None
    if t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        return t.contiguous()
    if t.dim() == 2 and t.shape[0] > 1 and t.stride(0) < t.shape[1]:
        return t.contiguous()
    if t.dim() == 1 and t.shape[0] > 1 and t.stride(0) != 1:
        return t.contiguous()
    return t


def _device(logits: Optional[Tensor], hidden: Optional[Tensor]) -> int:
    lead = logits if logits is not None else hidden
    return lead.device.index if lead.device.type == "cuda" else -1


def _run(mode: str, device: int, **kwargs):
    return _api.invoke_loss(mode, device, **kwargs)


def _empty_like_shape(ref: Tensor, shape, dtype) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=ref.device)


def _grad_buffers(logits, hidden, weight, bias, want_logits, want_hidden, want_weight, want_bias,
                  keep_weight_sum=False, scaled_later=False):
    """(grad_logits, grad_hidden, grad_weight, grad_bias, grad_weight_sum_tail); an empty tensor
    stands for a gradient not wanted (a custom op returns tensors, never None). With
    keep_weight_sum, a 16-bit weight's gradient has the weight's dtype and holds, with the tail,
    its float32 sum until lmloss_round_grad_weight rounds it in place; else a 16-bit weight's is
    float32. With scaled_later (the fused step's gradients, formed for an upstream gradient of 1),
    a float16 hidden state's gradient is float32 until backward scales it: its values, of order
    1 / tokens, would otherwise be rounded into float16's subnormals before a loss scale could
    lift them."""
    lead = logits if logits is not None else hidden

    def none():  # each output its own tensor: a custom op's outputs may not alias
        return _empty_like_shape(lead, (0,), lead.dtype)

    keep = keep_weight_sum and weight is not None and want_weight and weight.dtype in _LOW_PRECISION
    g_logits = torch.empty_like(logits, memory_format=torch.contiguous_format) if (
        logits is not None and want_logits) else none()
    hidden_grad_dtype = None
    if hidden is not None:
        wide = scaled_later and hidden.dtype == torch.float16
        hidden_grad_dtype = torch.float32 if wide else hidden.dtype
    g_hidden = _empty_like_shape(hidden, hidden.shape, hidden_grad_dtype) if (
        hidden is not None and want_hidden) else none()
    if keep:
        g_weight, tail = _weight_sum_buffers(weight)
    else:
        g_weight = _empty_like_shape(weight, weight.shape, _accumulate_dtype(weight.dtype)) if (
            weight is not None and want_weight) else none()
        tail = none()
    g_bias = _empty_like_shape(bias, bias.shape, _accumulate_dtype(bias.dtype)) if (
        bias is not None and want_bias) else none()
    return g_logits, g_hidden, g_weight, g_bias, tail


def _weight_sum_buffers(weight: Tensor) -> Tuple[Tensor, Tensor]:
    """A 16-bit weight's gradient, over whose bytes the first rows of its float32 sum are held,
    and the sum's tail: as the array functions take them (_api._weight_sum_buffers: for a
    vocabulary of a multiple of 16, the lower of two blocks of one size is the gradient, so that
    the tail never lies below it). Traced, the tensors may be fake: always aligned, never asked
    for their address. Where _keeps_rests, a bf16 weight's gradient holds the sum's bf16 values
    and the tail, uint8 of the weight's shape, their 8-bit rests."""
    if _keeps_rests(weight):
        return (_empty_like_shape(weight, weight.shape, weight.dtype),
                _empty_like_shape(weight, weight.shape, torch.uint8))
    vocab, hidden = weight.shape
    tail_rows = _api.weight_sum_tail_rows(vocab)
    if 2 * tail_rows != vocab or _traced(weight):
        return (_empty_like_shape(weight, weight.shape, weight.dtype),
                _empty_like_shape(weight, (tail_rows, hidden), torch.float32))
    w = as_array(weight, "weight")
    return _api._weight_sum_buffers(w, w.shape, w.dtype)


def _keeps_rests(weight: Tensor) -> bool:
    """Whether a bf16 weight's kept sum is its bf16 values and 8-bit rests: as _KEEP_WEIGHT_RESTS
    says where set, else where the library's one-kernel dW products of the pair run (sm_90a, a
    vocabulary of a multiple of 8, rows of 16): there, with the byte an entry it saves spent on
    larger token chunks, the step is faster than with the float32 sum in no more memory (run 77).
    Elsewhere its products go through float32 slices, slower (on the CPU too)."""
    if weight.dtype != torch.bfloat16:
        return False
    if _KEEP_WEIGHT_RESTS is not None:
        return _KEEP_WEIGHT_RESTS
    vocab, hidden = weight.shape
    return (weight.device.type == "cuda" and vocab % 8 == 0 and hidden % 16 == 0
            and _is_sm90(weight.device.index))


@functools.lru_cache(maxsize=None)
def _is_sm90(index: Optional[int]) -> bool:
    """Whether CUDA device `index` (None: the current one) is an sm_90 card, asked once: it is
    asked in every step."""
    return torch.cuda.get_device_capability(index) == (9, 0)


def _rests_extra_workspace(weight: Optional[Tensor], tail: Tensor) -> int:
    """The bytes a sum kept as values and rests (a uint8 tail) saves over the float32 sum's tail,
    which its call spends on workspace beyond the budget: larger token chunks, fewer passes over
    the sum, in the memory the float32 sum would hold."""
    if tail.dtype != torch.uint8 or tail.numel() == 0:
        return 0
    vocab, hidden = weight.shape
    return _api.weight_sum_tail_rows(vocab) * hidden * 4 - vocab * hidden


def _round_grad_weight_impl(grad_weight: Tensor, tail: Tensor, scale: Optional[Tensor]) -> None:
    """lmloss_round_grad_weight: grad_weight = its kept float32 sum (with the tail) times scale
    (None: 1), rounded once into its own dtype, in place."""
    _api.invoke_round_grad_weight(_device(None, grad_weight), grad_weight=grad_weight, tail=tail,
                                  scale=scale)


# The same as a custom op that says it writes grad_weight, so that a traced backward may call it
# on a tensor saved from forward (Inductor then runs it on that tensor's memory, which the
# backward donates).
_round_grad_weight = torch.library.custom_op(
    "lmloss::round_grad_weight", mutates_args=("grad_weight",))(_round_grad_weight_impl)


@_round_grad_weight.register_fake
def _(grad_weight, tail, scale):
    return None


def _traced(t: Tensor) -> bool:
    """Whether t is being traced (torch.compile, torch.export): a plain tensor or a parameter
    outside them, a fake or functional one inside. torch.compiler.is_compiling() alone does not
    say so everywhere: AOTAutograd's tracing of a backward formula, under PyTorch 2.11."""
    return torch.compiler.is_compiling() or type(t) not in (Tensor, torch.nn.Parameter)


def _round_weight_sum(grad_weight: Tensor, tail: Tensor, scale: Optional[Tensor],
                      deferred: Optional[Tensor] = None) -> Tensor:
    """grad_weight, its kept float32 sum rounded once into it, times scale (None: 1); with
    `deferred`, the last chunk's product its eager step left there stored over the sum as it is
    rounded (lmloss_round_grad_weight_deferred). Eagerly the library is called directly: the
    custom op's Python dispatch is host time in every backward."""
    if scale is not None:
        scale = scale.reshape(()).to(torch.float32).contiguous()
    if _traced(grad_weight):
        _round_grad_weight(grad_weight, tail, scale)
    elif deferred is not None:
        _api.invoke_round_grad_weight(_device(None, grad_weight), grad_weight=grad_weight,
                                      tail=tail, scale=scale, deferred=deferred)
    else:
        _round_grad_weight_impl(grad_weight, tail, scale)
    return grad_weight


def _present(t: Tensor) -> Optional[Tensor]:
    return t if t.numel() > 0 or t.dim() != 1 else None


# ---- The custom ops ------------------------------------------------------------------------
# One set of ops serves every loss: a head (logits, or hidden + weight + bias), the targets
# (labels, teacher top-k, mask) and the options, as in the C API.


def _loss_forward_impl(
    logits: Optional[Tensor], hidden: Optional[Tensor], weight: Optional[Tensor],
    bias: Optional[Tensor], labels: Optional[Tensor], teacher_ids: Optional[Tensor],
    teacher_probs: Optional[Tensor], token_mask: Optional[Tensor], reduction: str,
    ignore_index: int, normalizer: float, ce_weight: float, kd_weight: float,
    label_smoothing: float, z_loss: float, softcap: float, temperature: float,
) -> Tuple[Tensor, Tensor]:
    """(loss, lse): the loss, and log-sum-exp per token saved for a recomputing backward."""
    lead = logits if logits is not None else hidden
    n = lead.shape[0]
    compute = _compute_dtype(lead.dtype)
    loss = _empty_like_shape(lead, (n,) if reduction == "none" else (), compute)
    lse = _empty_like_shape(lead, (n,), compute)
    _run("forward", _device(logits, hidden), logits=_rows(logits), hidden=_rows(hidden),
         weight=_rows(weight), bias=_rows(bias), labels=_rows(labels),
         teacher_ids=_rows(teacher_ids), teacher_probs=_rows(teacher_probs),
         token_mask=_rows(token_mask), reduction=reduction, ignore_index=ignore_index,
         normalizer=normalizer, ce_weight=ce_weight, kd_weight=kd_weight,
         label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
         temperature=temperature, loss=loss, lse=lse)
    return loss, lse


_loss_forward = torch.library.custom_op("lmloss::loss_forward", mutates_args=())(
    _loss_forward_impl)


@_loss_forward.register_fake
def _(logits, hidden, weight, bias, labels, teacher_ids, teacher_probs, token_mask, reduction,
      ignore_index, normalizer, ce_weight, kd_weight, label_smoothing, z_loss, softcap,
      temperature):
    lead = logits if logits is not None else hidden
    n = lead.shape[0]
    compute = _compute_dtype(lead.dtype)
    loss = lead.new_empty((n,) if reduction == "none" else (), dtype=compute)
    return loss, lead.new_empty((n,), dtype=compute)


@torch.library.custom_op("lmloss::loss_backward", mutates_args=())
def _loss_backward(
    logits: Optional[Tensor], hidden: Optional[Tensor], weight: Optional[Tensor],
    bias: Optional[Tensor], labels: Optional[Tensor], teacher_ids: Optional[Tensor],
    teacher_probs: Optional[Tensor], token_mask: Optional[Tensor], reduction: str,
    ignore_index: int, normalizer: float, ce_weight: float, kd_weight: float,
    label_smoothing: float, z_loss: float, softcap: float, temperature: float, lse: Tensor,
    grad_loss: Tensor, want_logits: bool, want_hidden: bool, want_weight: bool, want_bias: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients from a saved lse and the upstream gradient, logits recomputed a chunk at a
    time; an empty tensor for each one not wanted."""
    g_logits, g_hidden, g_weight, g_bias, tail = _grad_buffers(
        logits, hidden, weight, bias, want_logits, want_hidden, want_weight, want_bias,
        keep_weight_sum=True)
    compute = lse.dtype
    _run("backward", _device(logits, hidden), logits=_rows(logits), hidden=_rows(hidden),
         weight=_rows(weight), bias=_rows(bias), labels=_rows(labels),
         teacher_ids=_rows(teacher_ids), teacher_probs=_rows(teacher_probs),
         token_mask=_rows(token_mask), reduction=reduction, ignore_index=ignore_index,
         normalizer=normalizer, ce_weight=ce_weight, kd_weight=kd_weight,
         label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
         temperature=temperature, lse=_rows(lse),
         grad_loss=grad_loss.to(compute).contiguous(),
         grad_logits=_present(g_logits), grad_hidden=_present(g_hidden),
         grad_weight=_present(g_weight), grad_bias=_present(g_bias),
         grad_weight_sum_tail=_present(tail), extra_workspace=_rests_extra_workspace(weight, tail))
    if tail.numel() > 0:  # the upstream gradient is in the sum already
        _round_weight_sum(g_weight, tail, None)
    return g_logits, g_hidden, g_weight, g_bias


@_loss_backward.register_fake
def _(logits, hidden, weight, bias, labels, teacher_ids, teacher_probs, token_mask, reduction,
      ignore_index, normalizer, ce_weight, kd_weight, label_smoothing, z_loss, softcap,
      temperature, lse, grad_loss, want_logits, want_hidden, want_weight, want_bias):
    return _grad_buffers(logits, hidden, weight, bias, want_logits, want_hidden, want_weight,
                         want_bias, keep_weight_sum=True)[:4]


def _fused_step(logits, hidden, weight, bias, labels, teacher_ids, teacher_probs, token_mask,
                reduction, ignore_index, normalizer, ce_weight, kd_weight, label_smoothing, z_loss,
                softcap, temperature, want_logits, want_hidden, want_weight, want_bias,
                keep_weight_sum, defer=False):
    """(loss, lse, grad_logits, grad_hidden, grad_weight, grad_bias, grad_weight_sum_tail,
    deferred): the fused step's outputs, and with `defer` the buffer in which a kept sum's step
    left its last chunk's dW product for the rounding (lmloss_loss_deferred_bytes), or None where
    it defers nothing."""
    lead = logits if logits is not None else hidden
    compute = _compute_dtype(lead.dtype)
    n = lead.shape[0]
    loss = _empty_like_shape(lead, (n,) if reduction == "none" else (), compute)
    lse = _empty_like_shape(lead, (n,), compute)
    g_logits, g_hidden, g_weight, g_bias, tail = _grad_buffers(
        logits, hidden, weight, bias, want_logits, want_hidden, want_weight, want_bias,
        keep_weight_sum, scaled_later=True)
    device = _device(logits, hidden)
    arrays = dict(
        logits=_rows(logits), hidden=_rows(hidden), weight=_rows(weight), bias=_rows(bias),
        labels=_rows(labels), teacher_ids=_rows(teacher_ids), teacher_probs=_rows(teacher_probs),
        token_mask=_rows(token_mask), reduction=reduction, ignore_index=ignore_index,
        normalizer=normalizer, ce_weight=ce_weight, kd_weight=kd_weight,
        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
        temperature=temperature, loss=loss, lse=lse, grad_logits=_present(g_logits),
        grad_hidden=_present(g_hidden), grad_weight=_present(g_weight),
        grad_bias=_present(g_bias), grad_weight_sum_tail=_present(tail))
    maker = _api.deferred_maker(lead) if defer and tail.numel() > 0 and device >= 0 else None
    deferred = _run("forward_backward", device, grad_weight_deferred=maker,
                    extra_workspace=_rests_extra_workspace(weight, tail), **arrays)
    return loss, lse, g_logits, g_hidden, g_weight, g_bias, tail, deferred


def _loss_forward_backward_impl(
    logits: Optional[Tensor], hidden: Optional[Tensor], weight: Optional[Tensor],
    bias: Optional[Tensor], labels: Optional[Tensor], teacher_ids: Optional[Tensor],
    teacher_probs: Optional[Tensor], token_mask: Optional[Tensor], reduction: str,
    ignore_index: int, normalizer: float, ce_weight: float, kd_weight: float,
    label_smoothing: float, z_loss: float, softcap: float, temperature: float,
    want_logits: bool, want_hidden: bool, want_weight: bool, want_bias: bool,
    keep_weight_sum: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, grad_logits, grad_hidden, grad_weight, grad_bias, grad_weight_sum_tail) in one
    pass, the gradients for an upstream gradient of 1 (reduction mean or sum); a 16-bit weight's
    gradient left as its kept float32 sum with keep_weight_sum (see _grad_buffers). Traced, the
    step defers nothing: a buffer held from forward to backward is not an output of the op."""
    return _fused_step(logits, hidden, weight, bias, labels, teacher_ids, teacher_probs,
                       token_mask, reduction, ignore_index, normalizer, ce_weight, kd_weight,
                       label_smoothing, z_loss, softcap, temperature, want_logits, want_hidden,
                       want_weight, want_bias, keep_weight_sum)[:7]


_loss_forward_backward = torch.library.custom_op("lmloss::loss_forward_backward", mutates_args=())(
    _loss_forward_backward_impl)


@_loss_forward_backward.register_fake
def _(logits, hidden, weight, bias, labels, teacher_ids, teacher_probs, token_mask, reduction,
      ignore_index, normalizer, ce_weight, kd_weight, label_smoothing, z_loss, softcap,
      temperature, want_logits, want_hidden, want_weight, want_bias, keep_weight_sum):
    lead = logits if logits is not None else hidden
    n = lead.shape[0]
    compute = _compute_dtype(lead.dtype)
    loss = lead.new_empty((n,) if reduction == "none" else (), dtype=compute)
    return (loss, lead.new_empty((n,), dtype=compute)) + tuple(_grad_buffers(
        logits, hidden, weight, bias, want_logits, want_hidden, want_weight, want_bias,
        keep_weight_sum, scaled_later=True))


# ---- Autograd --------------------------------------------------------------------------------

# Whether fused steps keep a 16-bit weight's gradient as its float32 sum over its own bytes (the
# default); False gives it a float32 tensor of its own: for benchmarks that set the two side by
# side.
_KEEP_WEIGHT_SUM = True
# Whether a bf16 weight's kept sum is its bf16 values, in the gradient's own bytes, and a uint8
# tail of their 8-bit rests (3 bytes an entry against the float32 sum's 4; the library's pair,
# which holds the sum to ~1e-5 and rounds it as the float32 sum would but for values on a rounding
# boundary): None (the default) where their products run fast (_keeps_rests), True or False
# always or never, for benchmarks and tests that set the two side by side. Read both where a
# traced graph's outputs are declared and where they are made: set it before compiling.
_KEEP_WEIGHT_RESTS = None
# Whether eager steps that keep it leave their last chunk's dW product to the rounding in backward
# where the library can (lmloss_loss_deferred_bytes; the default); False adds it into the sum in
# the step, for benchmarks and tests that set the two side by side.
_DEFER_WEIGHT_PRODUCT = True

_N_HEAD_TARGETS = 8  # logits, hidden, weight, bias, labels, teacher_ids, teacher_probs, token_mask
_N_OPTIONS = 9       # reduction ... temperature


def _setup_forward(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:_N_HEAD_TARGETS], output[1])
    ctx.options = inputs[_N_HEAD_TARGETS:_N_HEAD_TARGETS + _N_OPTIONS]
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # see _setup_forward_backward


def _no_grads(count: int):
    return (None,) * count


def _backward_forward(ctx, grad_loss, _grad_lse):
    if grad_loss is None:
        return _no_grads(_N_HEAD_TARGETS + _N_OPTIONS)
    _check_first_order(grad_loss)
    saved = ctx.saved_tensors
    head_targets, lse = saved[:_N_HEAD_TARGETS], saved[_N_HEAD_TARGETS]
    logits, hidden, weight, bias = head_targets[:4]
    need = ctx.needs_input_grad
    want = (need[0] and logits is not None, need[1] and hidden is not None,
            need[2] and weight is not None, need[3] and bias is not None)
    grads = _loss_backward(*head_targets, *ctx.options, lse, grad_loss, *want)
    out = [None] * (_N_HEAD_TARGETS + _N_OPTIONS)
    for i, (w, g, src) in enumerate(zip(want, grads, (logits, hidden, weight, bias))):
        if w:
            out[i] = g.to(src.dtype)
    return tuple(out)


_loss_forward.register_autograd(_backward_forward, setup_context=_setup_forward)


def _setup_forward_backward(ctx, inputs, output):
    head = inputs[:4]
    ctx.dtypes = tuple(None if t is None else t.dtype for t in head)
    ctx.want = inputs[_N_HEAD_TARGETS + _N_OPTIONS:_N_HEAD_TARGETS + _N_OPTIONS + 4]
    ctx.weight_sum_rounded = False
    ctx.deferred = None  # an eager step's deferred dW product (_EagerForwardBackward)
    ctx.save_for_backward(*output[2:7])
    ctx.mark_non_differentiable(*output[1:7])
    # Gradients of the outputs besides the loss are never used; materialised, they would be zero
    # tensors of the gradients' sizes (a float32 dW of 2 GiB at V 128256, H 4096) made in backward.
    ctx.set_materialize_grads(False)


_CAST_SLICE_BYTES = 64 << 20

_SECOND_ORDER = (
    "lmloss: second-order gradients are not implemented. A backward with create_graph=True "
    "through an lmloss loss forms gradients that are differentiable only in the upstream "
    "gradient (where that requires grad), never in the logits, hidden states, weight or bias: "
    "refused rather than given without those terms.")


def _refuse_second_order(ctx, *grads):
    raise RuntimeError(_SECOND_ORDER)


def _check_first_order(grad_loss: Tensor) -> None:
    """Raises in a backward that builds a graph (create_graph=True) for anything but a
    differentiable upstream gradient: the graph's only use would be derivatives lmloss does not
    form, which would silently come out as zero."""
    if torch.is_grad_enabled() and not grad_loss.requires_grad and not _traced(grad_loss):
        raise RuntimeError(_SECOND_ORDER)


# The recomputing backward's op, run with create_graph=True, records this in place of PyTorch's
# generic refusal of an op without a derivative.
_loss_backward.register_autograd(_refuse_second_order)


def _scale_gradient_impl(grad: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """grad * scale computed in float32 (float64 for a float64 grad) and rounded once into dtype, by
    the library in one pass (lmloss_scale_gradient): PyTorch's own product by a 0-dim device
    tensor takes a non-vectorised kernel: on an H200, 2.6 ms for the float32 dW of a 16-bit head at
    V 128256, H 4096 (0.8 ms here), 0.64 ms for its bf16 dX at N 32768 (0.2 ms here)."""
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    product = torch.float64 if grad.dtype == torch.float64 else torch.float32
    _api.invoke_scale_gradient(_device(None, grad), grad=_rows(grad),
                               scale=scale.reshape(()).to(product).contiguous(), out=out)
    return out


# The same as a custom op, for traced backwards; eager ones call the implementation directly.
_scale_gradient = torch.library.custom_op("lmloss::scale_gradient", mutates_args=())(
    _scale_gradient_impl)


@_scale_gradient.register_fake
def _(grad, scale, dtype):
    return grad.new_empty(grad.shape, dtype=dtype)


def _scaled_to(grad: Tensor, grad_loss: Tensor, dtype: torch.dtype) -> Tensor:
    """grad * grad_loss in dtype, rounded once. The library's scaling takes a gradient of rank 1
    or 2 (float64 on the CPU only); anything else goes through PyTorch, a slice of rows at a time
    where the dtype changes (a product whose out= has another dtype is computed into a full-size
    temporary first)."""
    if grad.requires_grad or grad_loss.requires_grad:
        # A backward that builds a graph (create_graph=True): PyTorch's differentiable product
        # (out= takes no part in autograd).
        return (grad * grad_loss).to(dtype)
    on_cpu = grad.device.type == "cpu"
    if (grad.dim() in (1, 2) and grad.dtype.is_floating_point and dtype.is_floating_point
            and (on_cpu or torch.float64 not in (grad.dtype, dtype))):
        scale = _scale_gradient if _traced(grad) else _scale_gradient_impl
        return scale(grad, grad_loss, dtype)
    if grad.dim() == 0 or grad.dtype == dtype:
        return torch.mul(grad, grad_loss, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    step = max(1, _CAST_SLICE_BYTES // max(1, grad[0].numel() * grad.element_size()))
    for r in range(0, grad.shape[0], step):
        torch.mul(grad[r:r + step], grad_loss, out=out[r:r + step])
    return out


def _backward_forward_backward(ctx, grad_loss, *_grads_of_aux):
    if grad_loss is None:
        return _no_grads(_N_HEAD_TARGETS + _N_OPTIONS + 5)
    _check_first_order(grad_loss)
    if ctx.weight_sum_rounded:  # before the saved tensors' own check, with the reason
        raise RuntimeError(
            "lmloss: a second backward through the same loss (retain_graph=True) cannot take a "
            "16-bit weight's gradient again: the first backward, whichever inputs it was asked "
            "for, rounded its float32 sum in place. Compute the loss again for each backward.")
    grads = ctx.saved_tensors
    tail = grads[4]
    out = [None] * (_N_HEAD_TARGETS + _N_OPTIONS + 5)
    for i in range(4):
        if not ctx.want[i]:
            continue
        if i == 2 and tail.numel() > 0:
            # The kept float32 sum times the upstream gradient, rounded once into its own bytes:
            # weight.grad with no float32 copy beside it. In place, so once per forward; a
            # backward that builds a graph takes PyTorch's product after the rounding.
            ctx.weight_sum_rounded = True
            deferred, ctx.deferred = ctx.deferred, None  # freed once stored
            if grad_loss.requires_grad:
                out[i] = torch.mul(_round_weight_sum(grads[i], tail, None, deferred), grad_loss)
            else:
                out[i] = _round_weight_sum(grads[i], tail, grad_loss, deferred)
        else:
            out[i] = _scaled_to(grads[i], grad_loss, ctx.dtypes[i])
    return tuple(out)


_loss_forward_backward.register_autograd(_backward_forward_backward,
                                         setup_context=_setup_forward_backward)


# ---- Eager calls -------------------------------------------------------------------------------
# Outside torch.compile the same functions and autograd formulas run through
# torch.autograd.Function: a custom op's Python dispatch layers (schema defaults, its autograd
# wrapper, the aliasing checks) are host time before a step's first kernel. On a small CPU case
# the fused forward's host time was 287 us through the custom op, 78 through the Function, 54 for
# the library call alone.


def _eager_function(name, impl, setup_context, backward):
    """A custom op's implementation, context setup and backward as a torch.autograd.Function."""
    def forward(ctx, *inputs):
        output = impl(*inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


class _EagerForwardBackward(torch.autograd.Function):
    """The fused step as _loss_forward_backward, its last chunk's dW product deferred to the
    rounding in backward where the library defers it (held on the context until then)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _fused_step(*inputs, defer=_DEFER_WEIGHT_PRODUCT)
        _setup_forward_backward(ctx, inputs, output)
        ctx.deferred = output[7]
        return output[:7]

    backward = staticmethod(_backward_forward_backward)


_EagerForward = _eager_function("_EagerForward", _loss_forward_impl, _setup_forward, _backward_forward)


# ---- The losses ------------------------------------------------------------------------------


def _wants(*tensors: Optional[Tensor]) -> Tuple[bool, ...]:
    enabled = torch.is_grad_enabled()
    return tuple(bool(enabled and t is not None and t.requires_grad) for t in tensors)


def _check_batched(t: Optional[Tensor], name: str, batch, lead_name: str, extra: bool = False):
    if t is None:
        return None
    shape = tuple(t.shape)
    if (extra and not shape) or (shape[:-1] if extra else shape) != tuple(batch):
        want = tuple(batch) + (("k",) if extra else ())
        raise ValueError(f"{name}: expected shape {want} to match the leading dimensions of "
                         f"{lead_name}, got {shape}")
    return t.reshape(math.prod(batch), shape[-1]) if extra else t.reshape(-1)


def _loss(logits, hidden, weight, bias, labels, teacher_ids, teacher_probs, token_mask, opts,
          batch, return_lse=False):
    """Runs the right op for the options and what needs a gradient; the loss reshaped to the
    tokens' leading dimensions for reduction "none", and with return_lse the tokens'
    log-sum-exp so shaped beside it."""
    for t, name in ((logits, "logits"), (hidden, "hidden"), (weight, "weight"), (bias, "bias")):
        check_not_sharded(t, name)
    want = _wants(logits, hidden, weight, bias)
    option_values = (opts["reduction"], opts["ignore_index"], opts["normalizer"],
                     opts["ce_weight"], opts["kd_weight"], opts["label_smoothing"],
                     opts["z_loss"], opts["softcap"], opts["temperature"])
    args = (logits, hidden, weight, bias, labels, teacher_ids, teacher_probs, token_mask)
    traced = torch.compiler.is_compiling()  # torch.compile and torch.export see the custom ops
    # float16 logits take their gradient in backward, the upstream gradient (a loss scale) inside
    # before its one rounding: the fused step's, formed for an upstream of 1, would fall into
    # float16's subnormals (given logits cost the same bytes either way).
    half_logits = logits is not None and logits.dtype == torch.float16
    fused = opts["reduction"] != "none" and not half_logits
    if any(want) and fused:
        # A 16-bit weight's gradient is summed in float32 over its own bytes and a tail and
        # rounded there in backward.
        step = _loss_forward_backward if traced else _EagerForwardBackward.apply
        loss, lse = step(*args, *option_values, *want, _KEEP_WEIGHT_SUM)[:2]
    elif traced:
        loss, lse = _loss_forward(*args, *option_values)
    elif any(want):
        loss, lse = _EagerForward.apply(*args, *option_values)
    else:
        loss, lse = _loss_forward_impl(*args, *option_values)
    if opts["reduction"] == "none":
        loss = loss.reshape(batch)
    return (loss, lse.reshape(batch)) if return_lse else loss


def _autocast(*tensors: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """The head's tensors as F.linear takes them under torch.autocast for their device: floating
    ones but float64 cast to autocast's dtype (the gradients flow back through the casts into
    the tensors' own dtypes); as they are outside it."""
    lead = tensors[0]
    if not isinstance(lead, Tensor) or not torch.is_autocast_enabled(lead.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(lead.device.type)
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point()
                 and t.dtype not in (dtype, torch.float64) else t for t in tensors)


def _tensor(t, name: str, optional: bool = False) -> Optional[Tensor]:
    if t is None and optional:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _check_head(weight, bias) -> None:
    _tensor(weight, "weight")
    _tensor(bias, "bias", optional=True)
    if weight.dim() != 2:
        raise ValueError(f"weight: expected shape (vocab, hidden), got {tuple(weight.shape)}")


def _lead_rows(t, name: str):
    _tensor(t, name)
    if t.dim() < 1:
        raise ValueError(f"{name}: expected shape (..., {'hidden' if name == 'hidden' else 'vocab'}), got a scalar")
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1]), tuple(t.shape[:-1])


def cross_entropy(logits: Tensor, labels: Tensor, *, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                  softcap: Optional[float] = None, temperature: float = 1.0,
                  normalizer: Optional[float] = None, return_lse: bool = False):
    """Cross-entropy of logits [..., V] against labels [...]; differentiable in logits. As
    torch.nn.functional.cross_entropy with the class dimension last, plus z-loss, soft-capping,
    temperature and a caller-given normalizer for "mean". With return_lse, (loss, lse): lse [...]
    the log-sum-exp of each token's scaled logits (no gradient), for logging a z-loss, say."""
    opts = _api.loss_options(reduction=reduction, ignore_index=ignore_index,
                             label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                             temperature=temperature, normalizer=normalizer)
    z, batch = _lead_rows(logits, "logits")
    y = _check_batched(_tensor(labels, "labels"), "labels", batch, "logits")
    return _loss(z, None, None, None, y, None, None, None, opts, batch, return_lse)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *,
                         bias: Optional[Tensor] = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: Optional[float] = None,
                         temperature: float = 1.0, normalizer: Optional[float] = None,
                         return_lse: bool = False):
    """Cross-entropy of hidden @ weight.T (+ bias) against labels, without the full logits.
    hidden [..., H], weight [V, H] (nn.Linear layout), labels [...]; differentiable in hidden,
    weight and bias. Under torch.autocast the product takes autocast's dtype, as F.linear's.
    With return_lse, (loss, lse) as cross_entropy's."""
    opts = _api.loss_options(reduction=reduction, ignore_index=ignore_index,
                             label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                             temperature=temperature, normalizer=normalizer)
    _check_head(weight, bias)
    hidden, weight, bias = _autocast(hidden, weight, bias)
    x, batch = _lead_rows(hidden, "hidden")
    y = _check_batched(_tensor(labels, "labels"), "labels", batch, "hidden")
    return _loss(None, x, weight, bias, y, None, None, None, opts, batch, return_lse)


def linear_distill(hidden: Tensor, weight: Tensor, teacher_ids: Tensor, teacher_probs: Tensor,
                   *, bias: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                   token_mask: Optional[Tensor] = None, ce_weight: float = 0.0,
                   kd_weight: float = 1.0, ignore_index: int = -100,
                   label_smoothing: float = 0.0, z_loss: float = 0.0,
                   softcap: Optional[float] = None, temperature: float = 1.0,
                   reduction: str = "mean", normalizer: Optional[float] = None,
                   return_lse: bool = False):
    """Top-k distillation (+ ce_weight * cross-entropy) through the head, without the full
    logits. teacher_ids/teacher_probs [..., k]; teacher_probs are cast to float32 (float64 for
    float64 inputs) and get no gradient. Under torch.autocast the product takes autocast's
    dtype, as F.linear's. With return_lse, (loss, lse) as cross_entropy's."""
    opts = _api.loss_options(reduction=reduction, ignore_index=ignore_index,
                             label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                             temperature=temperature, normalizer=normalizer,
                             ce_weight=ce_weight, kd_weight=kd_weight)
    _check_head(weight, bias)
    for t, name, optional in ((teacher_ids, "teacher_ids", False),
                              (teacher_probs, "teacher_probs", False), (labels, "labels", True),
                              (token_mask, "token_mask", True)):
        _tensor(t, name, optional)
    hidden, weight, bias = _autocast(hidden, weight, bias)
    x, batch = _lead_rows(hidden, "hidden")
    ids = _check_batched(teacher_ids, "teacher_ids", batch, "hidden", extra=True)
    probs = _check_batched(teacher_probs, "teacher_probs", batch, "hidden", extra=True)
    if tuple(teacher_probs.shape) != tuple(teacher_ids.shape):
        raise ValueError(f"teacher_probs: expected shape {tuple(teacher_ids.shape)} like "
                         f"teacher_ids, got {tuple(teacher_probs.shape)}")
    if probs is not None:
        probs = probs.detach().to(_compute_dtype(hidden.dtype))
    y = _check_batched(labels, "labels", batch, "hidden")
    mask = _check_batched(token_mask, "token_mask", batch, "hidden")
    return _loss(None, x, weight, bias, y, ids, probs, mask, opts, batch, return_lse)


# ---- Modules ---------------------------------------------------------------------------------


class LinearCrossEntropyLoss(torch.nn.Module):
    """loss = LinearCrossEntropyLoss()(hidden, lm_head.weight, labels[, bias]): the fused head
    and cross-entropy, for use in place of F.cross_entropy(lm_head(hidden), labels)."""

    def __init__(self, *, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, z_loss: float = 0.0,
                 softcap: Optional[float] = None, temperature: float = 1.0):
        super().__init__()
        _api.loss_options(reduction=reduction, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                          temperature=temperature, normalizer=None)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.temperature = temperature

    def forward(self, hidden: Tensor, weight: Tensor, labels: Tensor,
                bias: Optional[Tensor] = None, normalizer: Optional[float] = None) -> Tensor:
        return linear_cross_entropy(hidden, weight, labels, bias=bias,
                                    ignore_index=self.ignore_index, reduction=self.reduction,
                                    label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                                    softcap=self.softcap, temperature=self.temperature,
                                    normalizer=normalizer)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
                f"softcap={self.softcap}, temperature={self.temperature}")


class LinearDistillLoss(torch.nn.Module):
    """loss = LinearDistillLoss(ce_weight=0.5, kd_weight=0.5)(hidden, lm_head.weight, teacher_ids,
    teacher_probs, labels=labels): top-k distillation mixed with cross-entropy, in one pass."""

    def __init__(self, *, ce_weight: float = 0.0, kd_weight: float = 1.0,
                 ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                 softcap: Optional[float] = None, temperature: float = 1.0,
                 reduction: str = "mean"):
        super().__init__()
        _api.loss_options(reduction=reduction, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                          temperature=temperature, normalizer=None, ce_weight=ce_weight,
                          kd_weight=kd_weight)
        self.ce_weight = ce_weight
        self.kd_weight = kd_weight
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.temperature = temperature
        self.reduction = reduction

    def forward(self, hidden: Tensor, weight: Tensor, teacher_ids: Tensor, teacher_probs: Tensor,
                labels: Optional[Tensor] = None, token_mask: Optional[Tensor] = None,
                bias: Optional[Tensor] = None, normalizer: Optional[float] = None) -> Tensor:
        return linear_distill(hidden, weight, teacher_ids, teacher_probs, bias=bias,
                              labels=labels, token_mask=token_mask, ce_weight=self.ce_weight,
                              kd_weight=self.kd_weight, ignore_index=self.ignore_index,
                              label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                              softcap=self.softcap, temperature=self.temperature,
                              reduction=self.reduction, normalizer=normalizer)

    def extra_repr(self) -> str:
        return (f"ce_weight={self.ce_weight}, kd_weight={self.kd_weight}, "
                f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"temperature={self.temperature}, softcap={self.softcap}")
