"""What the fast path does differently on CPUs: feature probes (`cpu_has_amx`, `cpu_has_bf16`), one token's bits by
its own kernels (`exact_rows`), weights packed for oneDNN (`PackedWeights`) and the fp32 argmax (`argmax_ids`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def exact_rows(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fast path must give a token the same bits in a one-token step as in a many-token verification
    by its own choice of kernels (`FastTarget.forward` runs one token as two equal rows; `rows_exact_attention`),
    rather than by the vendor's.

    CPUs in bf16/fp16 without AMX. torch multiplies a single row with a matrix-vector kernel and several rows with
    oneDNN's GEMM, and its CPU SDPA kernel blocks queries by their count. On a CPU with AMX both agree row for row,
    so the vendor's kernels stay there; on one without (e.g. AMD EPYC with AVX512-BF16) the two products and SDPA
    round some rows differently, so a chain's verification drifts from plain decoding. GEMMs of 2..8 rows agree
    row for row there, a one-row product fed as two rows costs about the same, and attention as two batched GEMMs
    agrees row for row; plain decoding pays a little for it (docs/benchmarks.md). On CUDA the vendor kernels
    already agree, and in fp32 greedy output stays identical without it (tests/test_fast.py)."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and not cpu_has_amx()


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """Greedy token ids: argmax over the last dimension of logits [..., V] -> [...].

    On a CPU torch's bf16/fp16 argmax is several times slower than its fp32 one; the upcast is
    exact and both return the first maximum, so the ids are the same. Elsewhere the logits are used as they are."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits.argmax(dim=-1)


def available_memory() -> int | None:
    """Bytes of memory the system can give a process now without swapping (Linux `MemAvailable`), or None where
    that is not known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cpu_probe(name: str) -> bool:
    """torch's private CPU feature probe `torch.cpu.<name>`; False where this torch lacks it."""
    probe = getattr(torch.cpu, name, None)
    return bool(probe is not None and probe())


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Sapphire Rapids and later)."""
    return _cpu_probe("_is_amx_tile_supported")


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively: AMX tiles (Intel Sapphire Rapids and later) or AVX512-BF16 (AMD
    Zen 4 and later, some Intel). There a bf16 product of a few rows costs about what one row does, and bf16
    decoding is faster than fp32; elsewhere bf16 is emulated and slow."""
    return cpu_has_amx() or _cpu_probe("_is_avx512_bf16_supported")


def cpu_packs_weights(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a new `FastTarget` / `FastDrafter` multiplies by its matrices packed once into oneDNN's blocked
    layout (`PackedWeights`): in bf16 on CPUs with AVX512-BF16 and no AMX, where `exact_rows` runs every forward
    on two rows or more. There torch's bf16 `F.linear` takes about twice the time of the same product over a
    packed weight, with the same bits, and the packed product's rows agree whether it gets 2, 3, 4 or 8 of them.
    CPUs with AMX keep torch's kernels, whose one-row and many-row products agree there (`exact_rows`); CUDA
    never packs."""
    dev = torch.device(device)
    return (dev.type == "cpu" and dtype == torch.bfloat16 and cpu_has_bf16() and not cpu_has_amx()
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedWeights:
    """Copies of some matrices packed for oneDNN's product (`cpu_packs_weights`), found by the dense weight they
    copy: `linear(x, w, b)` is `F.linear(x, w, b)`, over the packed copy where `w` has one. The packing ops are
    those inductor's CPU weight prepacking emits (torch/_inductor/fx_passes/mkldnn_fusion.py in pytorch/pytorch:
    `mkldnn._reorder_linear_weight`, then `mkldnn._linear_pointwise` with no post-op)."""

    def __init__(self, weights: list[torch.Tensor], rows: int = 2):
        # rows: the product's row count the layout is chosen for (any count works; 2 is a one-token step's)
        self._packed = {self._key(w): torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights}

    @staticmethod
    def _key(w: torch.Tensor) -> tuple[int, tuple[int, ...]]:
        return w.data_ptr(), tuple(w.shape)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        packed = self._packed.get(self._key(w))
        if packed is None:
            return F.linear(x, w, b)
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def pack_weights(device: torch.device, dtype: torch.dtype, weights: list[torch.Tensor]) -> PackedWeights | None:
    """`PackedWeights` of these matrices where `cpu_packs_weights` says so, else None."""
    return PackedWeights(weights) if cpu_packs_weights(device, dtype) else None
