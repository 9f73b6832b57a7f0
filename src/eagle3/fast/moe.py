"""A routed mixture-of-experts MLP on the fast path: softmax top-k routing over E SwiGLU experts whose weights HF
keeps fused as `gate_up_proj` [E, 2·I, H] and `down_proj` [E, H, I] (Qwen3-MoE, Mixtral).

Every shape is static, so a step with experts captures in a CUDA graph like a dense one. How the experts run
depends on the step's token count N, fixed per captured shape:
- **N·k < E** (decoding, chains): each (token, expert) pair multiplies the token's row with that expert's
  matrices, gathered by index (the layout of pytorch-labs/gpt-fast `mixtral-moe/model.py`,
  `ConditionalFeedForward`). Only the chosen experts are read, and a token's result does not depend on the
  other tokens of the step.
- **N·k ≥ E** (trees, prefill): every expert runs on every token, and each token keeps its k chosen outputs.
  Gathering N·k matrices would copy more than all E.
Either way a token's k outputs are summed in the router's rank order with fp32 weights.

On a CPU, where nothing is captured and the host waits for every kernel anyway, the (token, expert) pairs are
grouped by expert on the host instead, and each expert multiplies its rows with its own matrices, as HF's loop
does: no weights are copied.
"""

from __future__ import annotations

import torch
from torch import nn

from eagle3.fast.pointwise import silu_gate


def experts_of(mlp: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(router, experts) of a routed MoE block the fast path runs, or None for any other MLP."""
    router, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    if router is None or experts is None or isinstance(router, nn.Linear):
        return None
    fused = all(isinstance(getattr(experts, n, None), torch.Tensor) for n in ("gate_up_proj", "down_proj"))
    routed = isinstance(getattr(router, "weight", None), torch.Tensor) and hasattr(router, "top_k")
    return (router, experts) if fused and routed else None


def moe_support(mlp: nn.Module) -> str | None:
    """None when `mlp` is a routed MoE block `RoutedExperts` runs exactly, else the reason it is not."""
    found = experts_of(mlp)
    if found is None:
        return f"{type(mlp).__name__} has no router with fused experts (gate_up_proj, down_proj)"
    router, experts = found
    if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
        return "its experts have biases"
    e, two_i, h = experts.gate_up_proj.shape
    if tuple(experts.down_proj.shape) != (e, h, two_i // 2) or tuple(router.weight.shape) != (e, h):
        return "its expert or router weights are not laid out as [E, 2·I, H], [E, H, I] and [E, H]"
    return None


class RoutedExperts(nn.Module):
    """One layer's routed experts: x [N, H] (normed) -> the weighted sum of its top-k experts' SwiGLU [N, H]. The
    weights are the HF module's own tensors, so in-place updates of the model reach it."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        router, experts = experts_of(mlp)
        self.register_buffer("router", router.weight.detach(), persistent=False)  # [E, H]
        self.register_buffer("w13", experts.gate_up_proj.detach(), persistent=False)  # [E, 2·I, H]
        self.register_buffer("w2", experts.down_proj.detach(), persistent=False)  # [E, H, I]
        self.top_k = int(router.top_k)
        # Qwen3-MoE renormalises the k weights where `norm_topk_prob`; Mixtral's router always does (no attribute)
        self.renormalise = bool(getattr(router, "norm_topk_prob", True))
        self.num_experts = self.w13.shape[0]

    def matrices(self) -> list[torch.Tensor]:
        """The router and each expert's two matrices [2·I, H] and [H, I] (views), for `PackedWeights`."""
        return [self.router] + [w for e in range(self.num_experts) for w in (self.w13[e], self.w2[e])]

    def active_bytes(self) -> int:
        """Bytes a one-token step reads: the router and k experts."""
        per_expert = (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()
        return self.router.numel() * self.router.element_size() + self.top_k * per_expert

    def route(self, x: torch.Tensor, linear=torch.nn.functional.linear) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's k experts [N, k] and their weights [N, k] (fp32), as HF's router picks them: softmax in
        fp32 over the router's logits, top-k, renormalised."""
        probs = torch.softmax(linear(x, self.router).float(), dim=-1)  # [N, E]
        weight, index = probs.topk(self.top_k, dim=-1)  # [N, k] each
        if self.renormalise:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return index, weight

    def forward(self, x: torch.Tensor, linear=torch.nn.functional.linear, gate=silu_gate, on_host: bool = False,
                min_rows: int = 1) -> torch.Tensor:
        """x [N, H] -> [N, H]. `on_host`: group by expert on the host (CPUs); `min_rows`: there, an expert's
        product takes at least this many rows (repeating its last), so that a product never drops to a one-row
        kernel whose rounding differs (`eagle3.fast.cpu.exact_rows`)."""
        n, k, hidden = x.shape[0], self.top_k, x.shape[-1]
        index, weight = self.route(x, linear)
        if on_host:
            out = self._by_expert(x, index.reshape(-1), linear, gate, min_rows).view(n, k, hidden)
        elif n * k < self.num_experts:  # the chosen experts' matrices, gathered: [N·k, 2·I, H] and [N·k, H, I]
            chosen = index.reshape(-1)  # [N·k]
            rows = x[:, None].expand(n, k, hidden).reshape(n * k, 1, hidden)  # [N·k, 1, H]
            up = torch.bmm(rows, self.w13[chosen].transpose(1, 2))  # [N·k, 1, 2·I]
            out = torch.bmm(gate(up), self.w2[chosen].transpose(1, 2)).view(n, k, hidden)  # [N, k, H]
        else:  # every expert on every token, then each token's k outputs
            up = torch.matmul(x, self.w13.transpose(1, 2))  # [E, N, 2·I]
            every = torch.matmul(gate(up), self.w2.transpose(1, 2))  # [E, N, H]
            out = every[index, torch.arange(n, device=x.device)[:, None]]  # [N, k, H]
        return (out.float() * weight[..., None]).sum(dim=1).to(x.dtype)  # [N, H]

    def _by_expert(self, x: torch.Tensor, chosen: torch.Tensor, linear, gate, min_rows: int) -> torch.Tensor:
        """The outputs [N·k, H] of the pairs `chosen` [N·k] (token i // k, expert chosen[i]), expert by expert."""
        k = self.top_k
        order = torch.argsort(chosen, stable=True)  # [N·k]: pairs grouped by expert
        rows = x[order // k]  # [N·k, H]
        experts, counts = torch.unique_consecutive(chosen[order], return_counts=True)
        out = torch.empty_like(rows)  # in grouped order
        start = 0
        for e, m in zip(experts.tolist(), counts.tolist(), strict=True):
            group = rows[start : start + m]
            if m < min_rows:
                group = torch.cat([group, group[-1:].expand(min_rows - m, -1)])
            out[start : start + m] = linear(gate(linear(group, self.w13[e])), self.w2[e])[:m]
            start += m
        paired = torch.empty_like(out)
        paired[order] = out  # back to pair order
        return paired
