"""lmloss: cross-entropy and top-k distillation losses at the head of a language model, forward
and backward, without ever holding the full [tokens x vocab] logits.

The functions here take NumPy arrays, PyTorch tensors or any array that speaks DLPack, run on
the arrays' device, and return results of the caller's kind. `lmloss.torch` adds autograd,
nn.Module losses and torch.compile support on top.
"""

import atexit as _atexit

from . import _lmloss
from ._api import (
    LossResult,
    TopkResult,
    backend_available,
    cross_entropy,
    linear_cross_entropy,
    linear_distill,
    peak_workspace,
    reset_peak_workspace,
    set_num_threads,
    set_product_tuning,
    set_workspace_budget,
    synchronize,
    topk,
    topk_logits,
    workspace_budget,
)

__version__ = _lmloss.version()

# Contexts may hold workspace from PyTorch's allocator: hand it back while PyTorch still exists.
_atexit.register(_lmloss.release_thread_state)

__all__ = [
    "LossResult",
    "TopkResult",
    "backend_available",
    "cross_entropy",
    "linear_cross_entropy",
    "linear_distill",
    "peak_workspace",
    "reset_peak_workspace",
    "set_num_threads",
    "set_product_tuning",
    "set_workspace_budget",
    "synchronize",
    "topk",
    "topk_logits",
    "workspace_budget",
]
