"""Inductor-compiled forwards for training: the frozen target's decoder layers and the drafter's norms and MLP.

A training step at SmolLM2 size spends most of its time in memory-bound elementwise kernels (RMSNorm's fp32
round trips, SwiGLU, RoPE, dtype casts) between small matmuls. Compiling the forward of those modules fuses
them. Measured on one H200 (docs/results/session15_train/, 32,768-token batches, random SmolLM2-shaped target,
the bundled drafter): the target's feature pass 55-60 ms -> 28-33 ms, the drafter's norms and MLP another
~10 ms, a whole step 159-168 ms -> 116-130 ms. Compiling the drafter's whole layer (attention with the TTT
slots, the cache) bought nothing more and took a minute to compile, so it stays eager.

Shapes change with every batch (rows x padded length), so the forwards compile with `dynamic=True`: one
compilation serves all lengths (one more for a batch of one row, which dynamo specialises). Only each module's
`forward` is replaced, so forward hooks (the target's aux-feature taps) still run eagerly around it, and
state-dict names do not change. A dynamo or inductor failure logs a warning and that module runs eagerly from
then on; errors of the computation itself propagate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch._dynamo import exc as _dynamo_exc

from eagle3.drafter import DrafterMLP, Eagle3Drafter, RMSNorm

log = logging.getLogger("eagle3")

# one code object (e.g. LlamaDecoderLayer.forward) is shared by every layer instance; each compiled instance may
# add a cache entry, so allow more than dynamo's default of 8 before it silently falls back to eager
RECOMPILE_LIMIT = 128


def compile_forward(module: nn.Module, what: str, backend: str | Callable = "inductor") -> None:
    """Replace this instance's `forward` by a dynamic-shape compilation of it, with an eager fallback."""
    eager = module.forward
    compiled: list[Callable | None] = [torch.compile(eager, dynamic=True, backend=backend)]

    def forward(*args, **kwargs):
        fn = compiled[0]
        if fn is None:
            return eager(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except _dynamo_exc.TorchDynamoException as e:  # tracing or code generation failed before it ran
            log.warning("torch.compile of %s failed (%s: %s); running it eagerly", what, type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")
            compiled[0] = None
            return eager(*args, **kwargs)

    module.forward = forward


def _raise_recompile_limit() -> None:
    from torch import _dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch releases
        if hasattr(_dynamo.config, name):
            setattr(_dynamo.config, name, max(getattr(_dynamo.config, name), RECOMPILE_LIMIT))


def compile_target_layers(layers: Iterable[nn.Module], backend: str | Callable = "inductor") -> int:
    """Compile the forward of every decoder layer of a frozen target; returns how many."""
    _raise_recompile_limit()
    n = 0
    for i, layer in enumerate(layers):
        compile_forward(layer, f"target layer {i}", backend)
        n += 1
    return n


def compile_drafter_pieces(drafter: Eagle3Drafter, backend: str | Callable = "inductor") -> int:
    """Compile the drafter's RMSNorms and MLP (trained: the backward is compiled too); returns how many."""
    _raise_recompile_limit()
    n = 0
    for name, module in drafter.named_modules():
        if isinstance(module, (RMSNorm, DrafterMLP)):
            compile_forward(module, f"drafter {name}", backend)
            n += 1
    return n
