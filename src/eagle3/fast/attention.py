"""The fast target's attention over its static caches: GQA with each KV head's query heads stacked along the query
axis, one cache per row, and the choice between split and sdpa.

Stacked: q [B, n_kv, g·T, hd] against k [B, n_kv, S, hd], one plain batched attention, K/V never repeated. (The query
heads as SDPA heads with `enable_gqa` made plain decoding on CUDA faster, but cuDNN then runs one query row with
other kernels than several, so bf16 chains were no longer identical to plain decoding: docs/benchmarks.md.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3.config import TARGET_ATTENTION, ConfigError
from eagle3.fast import split_attention as split


def rows_exact_attention(
    q: torch.Tensor,  # [nkv, R, hd]
    k: torch.Tensor,  # [nkv, S, hd]
    v: torch.Tensor,  # [nkv, S, hd]
    bias: torch.Tensor,  # [1, R, S] additive
    scale: float,
) -> torch.Tensor:
    """Attention in two batched GEMMs (scores scaled and biased in the first, softmax in fp32, the weights back
    in the model dtype for the second), whose rows do not depend on how many come with them when there are at
    least two (`exact_rows`; `FastTarget.forward_rows` runs a single token as two rows). Returns [nkv, R, hd]."""
    scores = torch.baddbmm(bias, q, k.transpose(-1, -2), alpha=scale)  # [nkv, R, S]
    return torch.bmm(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)  # [nkv, R, hd]


def row_attention_bias(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask [B, T, S] -> additive bias [B, 1, g·T, S] for `row_attention` (row r·T + t is token t)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return bias.repeat(1, groups, 1)[:, None]


def row_attention(
    q: torch.Tensor,  # [B, T, nh, hd]
    k_rows: torch.Tensor,  # [B, nkv, S, hd]
    v_rows: torch.Tensor,  # [B, nkv, S, hd]
    bias: torch.Tensor,  # [B, 1, g·T, S] from row_attention_bias
    scale: float,
    exact: bool = False,
) -> torch.Tensor:
    """GQA attention of B rows, each over its own cache, without repeating K/V (each KV head's query heads
    stacked); `exact`: by `rows_exact_attention` (`exact_rows`). Returns [B·T, nh·hd]."""
    b, t, nh, hd = q.shape
    nkv, s = k_rows.shape[1], k_rows.shape[2]
    g = nh // nkv
    qg = q.view(b, t, nkv, g, hd).permute(0, 2, 3, 1, 4).reshape(b, nkv, g * t, hd)  # head kv·g + r: row r·T + t
    if exact:  # every (row, KV head) its own pair of GEMMs
        o = rows_exact_attention(qg.reshape(b * nkv, g * t, hd), k_rows.reshape(b * nkv, s, hd),
                                 v_rows.reshape(b * nkv, s, hd), bias.expand(b, nkv, g * t, s).reshape(b * nkv, g * t, s),
                                 scale).view(b, nkv, g * t, hd)
    else:
        o = F.scaled_dot_product_attention(qg, k_rows, v_rows, attn_mask=bias, scale=scale)  # [B, nkv, g·T, hd]
    return o.view(b, nkv, g, t, hd).permute(0, 3, 1, 2, 4).reshape(b * t, nh * hd)


def _split_unusable(device: torch.device | str, head_dim: int) -> str | None:
    """Why the split attention cannot run for this target, or None."""
    if torch.device(device).type != "cuda":
        return "needs a CUDA device"
    if not split.triton_available():
        return "needs Triton (it comes with PyTorch's CUDA wheels)"
    if not split.supports(head_dim, 1):
        return f"takes head sizes {', '.join(map(str, split.HEAD_DIMS))}, not {head_dim}"
    return None


def target_attention_for(choice: str | None, device: torch.device | str, head_dim: int) -> str:
    """`FastOptions.target_attention` for a target on `device`: "split" or "sdpa". None or "auto": split where
    it can run (CUDA, Triton, a head size `eagle3.fast.split_attention`
    takes), sdpa elsewhere. "split" where it cannot run is a configuration error."""
    unusable = _split_unusable(device, head_dim)
    if choice is None or choice == "auto":
        return "split" if unusable is None else "sdpa"
    if choice not in TARGET_ATTENTION:
        raise ConfigError(f"target attention {choice!r}: expected one of {TARGET_ATTENTION}")
    if choice == "split" and unusable is not None:
        raise ConfigError(f"target attention split {unusable}; use auto or sdpa")
    return choice
