"""Inductor-compiled forwards for training: the frozen target's decoder layers and the drafter's norms and MLP.

A training step at SmolLM2 size spends most of its time in memory-bound elementwise kernels (RMSNorm's fp32
round trips, SwiGLU, RoPE, dtype casts) between small matmuls. Compiling the forward of those modules fuses
them, which shortens a step on CUDA (docs/benchmarks.md). Compiling the drafter's whole layer (attention with
the TTT slots, the cache) bought nothing more and took a minute to compile, so it stays eager.

Shapes change with every batch (rows x padded length), so the forwards compile with `dynamic=True`: one
compilation serves all lengths (one more for a batch of one row, which dynamo specialises). Only each module's
`forward` is replaced, so forward hooks (the target's aux-feature taps) still run eagerly around it, and
state-dict names do not change. A dynamo or inductor failure logs a warning and that module runs eagerly from
then on; errors of the computation itself propagate (`eagle3.fast.graphs.CompiledPieces`, shared with the fast
path's compiled drafting).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from torch import nn

from eagle3.drafter import DrafterMLP, Eagle3Drafter, RMSNorm
from eagle3.fast.graphs import CompiledPieces, raise_recompile_limit

# every decoder layer runs the same code object (e.g. LlamaDecoderLayer.forward); allow more compilations of it
# than the fast path's default before dynamo silently falls back to eager
TARGET_RECOMPILE_LIMIT = 128


def compile_forward(module: nn.Module, what: str, backend: str | Callable = "inductor") -> None:
    """Replace this instance's `forward` by a dynamic-shape compilation of it, with `CompiledPieces`' eager
    fallback (warnings name it `what`)."""
    pieces = CompiledPieces(module, label=what)
    pieces.compile(["forward"], backend, dynamic=True, fullgraph=False)
    module.forward = functools.partial(pieces.run, "forward")


def compile_target_layers(layers: Iterable[nn.Module], backend: str | Callable = "inductor") -> int:
    """Compile the forward of every decoder layer of a frozen target; returns how many."""
    raise_recompile_limit(TARGET_RECOMPILE_LIMIT)
    n = 0
    for i, layer in enumerate(layers):
        compile_forward(layer, f"target layer {i}", backend)
        n += 1
    return n


def compile_drafter_pieces(drafter: Eagle3Drafter, backend: str | Callable = "inductor") -> int:
    """Compile the drafter's RMSNorms and MLP (trained: the backward is compiled too); returns how many."""
    n = 0
    for name, module in drafter.named_modules():
        if isinstance(module, (RMSNorm, DrafterMLP)):
            compile_forward(module, f"drafter {name}", backend)
            n += 1
    return n
