"""The EAGLE-3 drafter: fuse three target layers, run one Llama-style decoder layer, predict the next token.

Forward pass for one row (SafeAILab/EAGLE `eagle/model/cnets.py`):

    h  = fc(cat[h_low, h_mid, h_high])                      # [T, 3Ht] -> [T, H]   (first draft step)
    h  = previous pre-norm drafter output                   # [T, H]               (later draft steps)
    u  = cat[input_layernorm(embed(x)), hidden_norm(h)]     # [T, 2H]  embeddings first
    r1 = h + o_proj(attn(q(u), k(u), v(u)))                 # residual on the un-normalised h
    r2 = r1 + mlp(post_attention_layernorm(r1))             # SwiGLU
    logits = lm_head(norm(r2))                              # [T, Vd], mapped to target ids by d2t

State-dict names follow the speculators format (`layers.0.*`), so saving for vLLM is a dump.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from eagle3.config import ConfigError, DrafterConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back (as EAGLE `cnets.py` L370-384)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


@dataclass
class DrafterKV:
    """The drafter's key/value cache: post-RoPE keys and values, [B, n_kv, S, hd], grown by appending.

    The engine keeps only rows computed from *target* features across cycles (`crop` drops tree rows);
    training appends one block of T keys per TTT step.
    """

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys = self.keys[:, :, :length]
            self.values = self.values[:, :, :length]

    def gather(self, keep: torch.Tensor) -> None:
        """Keep cache positions `keep` (1-D long), in that order."""
        if self.keys is not None:
            self.keys = self.keys.index_select(2, keep)
            self.values = self.values.index_select(2, keep)


@dataclass
class TTTMask:
    """The attention pattern of training-time-test step k, kept structured instead of as a dense mask.

    Keys are [K0 | K1 | ... | Kk] (one block of T per step, `DrafterKV` order). Row t sees the step-0 keys that
    `base` allows and, of each later block, only its own key Kj[t] (`eagle3.training.ttt.step_mask` is the dense
    equivalent). A dense mask makes attention cost (k+1)·T² per step although blocks 1..k hold one key per row.
    """

    base: torch.Tensor | None  # bool [B, 1, T, T], True = attend; None = causal (row t sees step-0 keys 0..t)


def ttt_attention(
    q: torch.Tensor,  # [B, nh, T, hd]
    k: torch.Tensor,  # [B, nh, (n+1)·T, hd]: step-0 keys, then one block per later step
    v: torch.Tensor,  # [B, nh, (n+1)·T, hd]
    base: torch.Tensor | None,  # bool [B, 1, T, T]; None = causal
) -> torch.Tensor:
    """Softmax attention under a `TTTMask`, [B, nh, T, hd], as one SDPA call over T + n keys.

    Row t's own keys k_j[t] (j = 1..n) become n "slot" keys shared by all rows: q is widened by n dimensions
    holding its own scores q·k_j[t], slot j is the unit vector of dimension j, so its score for row t is exactly
    q_t·k_j[t]; slot j's value is the unit vector of value dimension j, so the output there is slot j's softmax
    weight p_j[t], normalised together with the step-0 keys. The result is o[:hd] + sum_j p_j[t]·v_j[t], the
    same as SDPA under the dense `step_mask` (tests/test_ttt.py) at the cost of one step-0 attention instead
    of n+1, and causal (flash) kernels stay usable: slots first, then a lower-right causal mask.
    """
    b, nh, t, hd = q.shape
    n = k.shape[2] // t - 1
    k0, v0 = k[:, :, :t], v[:, :, :t]
    if n == 0:
        return F.scaled_dot_product_attention(q, k0, v0, attn_mask=base, is_causal=base is None)
    k_own = k[:, :, t:].unflatten(2, (n, t))  # [B, nh, n, T, hd]
    v_own = v[:, :, t:].unflatten(2, (n, t))
    s_own = (q.unsqueeze(2) * k_own).sum(-1).transpose(-1, -2)  # [B, nh, T, n] unscaled q_t·k_j[t]
    w = -(-n // 8) * 8  # extra width, a multiple of 8 for the fused kernels
    slots = F.pad(torch.eye(n, w, dtype=q.dtype, device=q.device), (hd, 0)).expand(b, nh, n, hd + w)  # e_{hd+j}
    qx = torch.cat([q, F.pad(s_own.to(q.dtype), (0, w - n))], dim=-1)  # [B, nh, T, hd+w]
    kx = torch.cat([slots, F.pad(k0, (0, w))], dim=2)  # [B, nh, n+T, hd+w]
    vx = torch.cat([slots.to(v.dtype), F.pad(v0, (0, w))], dim=2)
    if base is None:
        mask = causal_lower_right(t, n + t)  # row t sees the n slots and step-0 keys 0..t
    else:
        mask = torch.cat([base.new_ones(*base.shape[:3], n).expand(base.shape[0], 1, t, n), base], dim=-1)
    o = F.scaled_dot_product_attention(qx, kx, vx, attn_mask=mask, scale=hd**-0.5)  # [B, nh, T, hd+w]
    p_own = o[..., hd : hd + n].transpose(-1, -2).unsqueeze(-1)  # [B, nh, n, T, 1]
    return o[..., :hd] + (p_own * v_own).sum(2)


def rope_config(cfg: DrafterConfig) -> LlamaConfig:
    """An HF LlamaConfig carrying only the drafter's RoPE settings, so every HF rope type is honoured."""
    params: dict = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling:
        params = {**cfg.rope_scaling, "rope_theta": float(cfg.rope_scaling.get("rope_theta", cfg.rope_theta))}
        params.setdefault("rope_type", params.pop("type", "default"))
    return LlamaConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.resolved_head_dim,
        max_position_embeddings=max(
            cfg.max_position_embeddings, int(params.get("original_max_position_embeddings", 0)) + 1
        ),
        rope_parameters=params,
    )


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.resolved_head_dim
        two_h = 2 * cfg.hidden_size
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(two_h, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(two_h, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(two_h, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=bias)

    def forward(
        self,
        u: torch.Tensor,  # [B, T, 2H]
        cos: torch.Tensor,  # [B, T, hd]
        sin: torch.Tensor,
        mask: torch.Tensor | TTTMask | None,  # bool [B or 1, 1, T, S] (True = attend), S = cached + T
        cache: DrafterKV | None,
    ) -> torch.Tensor:
        b, t, _ = u.shape
        q = self.q_proj(u).view(b, t, self.nh, self.hd).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(u).view(b, t, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(u).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)  # [B, nkv, S, hd]
        if mask is None:
            s = k.shape[2]
            mask = torch.ones(t, s, dtype=torch.bool, device=u.device).tril(s - t)[None, None]
        # GQA: sdpa's enable_gqa needs torch >= 2.5; repeat explicitly to stay version-neutral
        if self.nkv != self.nh:
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        if isinstance(mask, TTTMask):
            o = ttt_attention(q, k, v, mask.base)  # [B, nh, T, hd]
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, nh, T, hd]
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """The first (and only) drafter layer: q/k/v read the 2H concatenation [embeds | fused hidden]."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.self_attn = DrafterAttention(cfg)
        self.mlp = DrafterMLP(cfg)

    def forward(self, emb, hidden, cos, sin, mask, cache):
        normed = self.hidden_norm(hidden)  # [B, T, H]
        residual = normed if self.norm_before_residual else hidden
        u = torch.cat([self.input_layernorm(emb), normed], dim=-1)  # [B, T, 2H]
        r1 = residual + self.self_attn(u, cos, sin, mask, cache)
        return r1 + self.mlp(self.post_attention_layernorm(r1))  # [B, T, H], pre-norm


class Eagle3Drafter(nn.Module):
    """An EAGLE-3 drafter. Use `combine` on target aux features, then `forward`, then `logits`."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        h, ht = cfg.hidden_size, cfg.resolved_target_hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)  # frozen copy of the target's embedding
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(3 * ht, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(ht, cfg.rms_norm_eps) for _ in range(3)])
        self.fc = nn.Linear(3 * ht, h, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(cfg)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        # d2t: offsets, target_id = draft_id + d2t[draft_id]; t2d: target ids present in the draft vocab
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool) if not cfg.uses_draft_vocab
                             else torch.zeros(cfg.vocab_size, dtype=torch.bool))
        if cfg.uses_draft_vocab:
            self.t2d[: cfg.draft_vocab_size] = True  # identity until a vocabulary mapping is set
        self.rotary_emb = LlamaRotaryEmbedding(rope_config(cfg))

    # -- vocabulary --------------------------------------------------------------------------
    def set_vocab_mapping(self, draft_to_target_ids: torch.Tensor) -> None:
        """Set d2t/t2d from the ascending target ids that make up the draft vocabulary ([Vd] long)."""
        ids = draft_to_target_ids.to(torch.long).cpu()
        vd, v = self.config.draft_vocab_size, self.config.vocab_size
        if ids.numel() != vd:
            raise ConfigError(f"vocabulary mapping has {ids.numel()} ids, draft_vocab_size is {vd}")
        if ids.min() < 0 or ids.max() >= v or not bool((ids[1:] > ids[:-1]).all()):
            raise ConfigError(f"draft vocabulary ids must be strictly ascending target ids in [0, {v})")
        self.d2t.copy_(ids - torch.arange(vd))
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True

    def draft_ids_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def load_target_embedding(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ConfigError(
                f"target embedding has shape {tuple(weight.shape)}, drafter expects "
                f"{tuple(self.embed_tokens.weight.shape)} (vocab_size, hidden_size)"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    # -- forward -----------------------------------------------------------------------------
    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """Fuse target features [B, T, 3Ht] into drafter hidden states [B, T, H] (applied once, pitfall 7)."""
        ht = self.config.resolved_target_hidden_size
        if aux.shape[-1] != 3 * ht:
            raise ConfigError(f"aux hidden states have width {aux.shape[-1]}, drafter expects 3*{ht}={3 * ht}")
        if self.config.fc_norm:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.split(ht, dim=-1), strict=True)], dim=-1)
        elif self.config.norm_before_fc:
            aux = self.input_norm(aux)
        return self.fc(aux.to(self.fc.weight.dtype))

    def forward(
        self,
        hidden: torch.Tensor,  # [B, T, H]: combine(aux) or a previous feedback(out)
        input_ids: torch.Tensor,  # [B, T] target-vocabulary ids (x_{t+1} for feature row t)
        position_ids: torch.Tensor,  # [B, T]
        mask: torch.Tensor | TTTMask | None = None,  # bool [B|1, 1, T, cached + T]; None = causal after the cache
        cache: DrafterKV | None = None,
    ) -> torch.Tensor:
        """Returns the pre-norm output [B, T, H]; `logits(out)` gives draft-vocab logits."""
        emb = self.embed_tokens(input_ids).to(hidden.dtype)  # [B, T, H]
        cos, sin = self.rotary_emb(hidden, position_ids)
        return self.layers[0](emb, hidden, cos, sin, mask, cache)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))  # [..., Vd]

    def feedback(self, out: torch.Tensor) -> torch.Tensor:
        """The hidden state fed to the next draft step: pre-norm (official), post-norm if `norm_output`."""
        return self.norm(out) if self.config.norm_output else out

    def trainable_parameters(self):
        return [p for n, p in self.named_parameters() if not n.startswith("embed_tokens")]
