"""Which attention kernels run where the shapes change from call to call.

With torch 2.11 on Hopper and Blackwell GPUs, `scaled_dot_product_attention` calls that carry an explicit mask
go to cuDNN first, and cuDNN builds an execution plan for every new shape (the fact and the switch are from
modelscope/FunASR issue #3704 and pytorch/pytorch PR #155958). Our mask-carrying paths change shape all the
time: the server's batch cache widens by one or more tokens every cycle, the generic engine's cache grows per
cycle, and every training batch has its own padded length, so planning there costs far more host time than
the attention itself. Those paths run under
`varying_shape_attention`, which leaves cuDNN out; flash, memory-efficient and math kernels stay. On the
static-cache fast path (`eagle3.fast`) only the prefill varies (one prompt length per request, one padded width
per batched prefill) and runs under it; its decoding cycles have fixed shapes, captured once in CUDA graphs, and
keep the default order.

"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_state = threading.local()  # .depth: nesting of varying_shape_attention in this thread


@contextlib.contextmanager
def varying_shape_attention(device: torch.device | str) -> Iterator[None]:
    """A context for forwards whose attention shapes vary: SDPA without the cuDNN backend on CUDA (no change on
    other devices), and `shapes_vary()` true inside it."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        if torch.device(device).type != "cuda":
            yield
            return
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            yield
    finally:
        _state.depth -= 1


def shapes_vary() -> bool:
    """Whether this thread runs inside `varying_shape_attention`."""
    return getattr(_state, "depth", 0) > 0
