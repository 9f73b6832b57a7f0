"""The EAGLE-3 drafter over static KV caches, one per row: same maths as `eagle3.drafter.Eagle3Drafter`, fixed
shapes.

Rows are written at cache slots given as device tensors and attend through a `[B, T, S]` boolean mask or by
position (the split kernels), so the draft steps can be captured in a CUDA graph. Slot s holds the drafter row at
RoPE position s for rows computed from target features; tree-expansion rows live in scratch slots above the
committed length and are overwritten by the next commit (see `eagle3.fast.rows`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.config import ConfigError
from eagle3.decoding.expand import top_k_last
from eagle3.decoding.sampling import token_hash
from eagle3.drafter import Eagle3Drafter
from eagle3.fast import split_attention
from eagle3.fast.attention import (
    row_attention,
    row_attention_bias,
)
from eagle3.fast.cpu import pack_weights
from eagle3.fast.pointwise import apply_rope, rms_norm, rope_tables
from eagle3.fast.split_attention import triton_available


def ranked_top_k(device: torch.device | str) -> bool:
    """Whether compiled drafting pieces (`FastRows.compile_drafting`) pick their top-k and rerank by ranking
    (`eagle3.decoding.expand.top_k_last` and `top_n_in_order` with `ranked`): on CUDA, where each torch.topk is a
    radix select in several passes however small its input, while inductor fuses the ranking's comparisons and
    sums into a few short kernels. Eager pieces and CPUs keep torch.topk: run op by op, the ranking is more
    kernels, not fewer."""
    return torch.device(device).type == "cuda"


def draft_top_k_op_for(drafter: FastDrafter | None, k: int):
    """`eagle3.fast.draft_top_k`'s op for drafting the top `k` with `drafter`, where it runs (CUDA with Triton, k
    within the kernels' bounds), else None."""
    if drafter is None or drafter.device.type != "cuda" or not triton_available():
        return None
    from eagle3.fast import draft_top_k

    return draft_top_k.draft_top_k_op() if draft_top_k.takes(k, drafter.lm_head.shape[0]) else None


# The tensors `FastDrafter.load_weights` rewrites in place (the embedding is the target's: never written)
WEIGHTS = ("fc", "input_norm", "fc_norm", "hidden_norm", "input_layernorm", "post_ln", "wqkv", "bqkv", "wo", "bo",
           "w13", "b13", "w2", "b2", "norm", "lm_head", "d2t", "draft_h")


class FastDrafter(nn.Module):
    """Weights of an `Eagle3Drafter` (fused q/k/v and gate/up); the caches are the rows' (`forward_rows`)."""

    def __init__(self, drafter: Eagle3Drafter):
        super().__init__()
        self._source = [drafter]  # shares its unfused tensors (a list: not a submodule); see `load_weights`
        cfg = drafter.config
        self.config = cfg
        layer = drafter.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        self.nh, self.nkv, self.hd = attn.nh, attn.nkv, attn.hd
        self.hidden_size = cfg.hidden_size
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.hd**-0.5
        self.norm_before_residual = cfg.norm_before_residual
        self.norm_output = cfg.norm_output

        def buf(name: str, t: torch.Tensor | None) -> None:
            self.register_buffer(name, None if t is None else t.detach(), persistent=False)

        buf("embed", drafter.embed_tokens.weight)
        buf("fc", drafter.fc.weight)
        buf("input_norm", drafter.input_norm.weight if cfg.norm_before_fc else None)
        buf("fc_norm", torch.stack([n.weight for n in drafter.fc_norm]) if cfg.fc_norm else None)  # [3, Ht]
        buf("hidden_norm", layer.hidden_norm.weight)
        buf("input_layernorm", layer.input_layernorm.weight)
        buf("post_ln", layer.post_attention_layernorm.weight)
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        buf("wqkv", torch.cat([p.weight for p in qkv]))
        buf("bqkv", torch.cat([p.bias for p in qkv]) if attn.q_proj.bias is not None else None)
        buf("wo", attn.o_proj.weight)
        buf("bo", attn.o_proj.bias)
        buf("w13", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        buf("b13", torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]) if mlp.gate_proj.bias is not None else None)
        buf("w2", mlp.down_proj.weight)
        buf("b2", mlp.down_proj.bias)
        buf("norm", drafter.norm.weight)
        buf("lm_head", drafter.lm_head.weight)
        buf("d2t", drafter.d2t)
        buf("draft_h", token_hash(self.to_target_ids(torch.arange(self.lm_head.shape[0], device=self.d2t.device))))
        self._rotary = [drafter.rotary_emb]  # a list, so it is not registered as a submodule
        self.dtype = self.fc.dtype
        self.paths_op = None  # `use_paths_attention`
        self.packed = self._pack()

    @property
    def device(self) -> torch.device:
        return self.fc.device

    def _pack(self):
        """Packed copies of the matrices for this device's products (`cpu_packs_weights`), or None."""
        return pack_weights(self.device, self.dtype, [self.fc, self.wqkv, self.wo, self.w13, self.w2, self.lm_head])

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear`, over a packed copy of `w` where this drafter packs its weights (`cpu_packs_weights`)."""
        return F.linear(x, w, b) if self.packed is None else self.packed.linear(x, w, b)

    def use_paths_attention(self) -> None:
        """Let `forward_rows` attend by position (`split_attention.split_paths_op`, resolved here, outside traced
        code): the server's rows draft this way where their target attends by the split kernel."""
        if not split_attention.supports(self.hd, 1):
            raise ConfigError(f"the split attention takes head sizes {split_attention.HEAD_DIMS}, not {self.hd}")
        self.paths_op = split_attention.split_paths_op()

    @torch.no_grad()
    def rope_table(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [S, hd] for positions 0..seq_len-1, from the drafter's rotary module."""
        dev, dt = self.device, self.dtype
        pos = torch.arange(seq_len, device=dev)[None]  # [1, S]
        cos, sin = self._rotary[0](torch.zeros(1, dtype=dt, device=dev), pos)  # [1, S, hd]
        return rope_tables(cos[0].to(dt), sin[0].to(dt))

    def weight_bytes(self) -> int:
        skip = {"embed", "d2t"}
        return sum(b.numel() * b.element_size() for n, b in self.named_buffers() if n not in skip)

    # -- the maths of Eagle3Drafter ------------------------------------------------------------
    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """Target features [T, 3·Ht] -> drafter hidden states [T, H] (fc, with the optional input norms)."""
        if self.fc_norm is not None:
            ht = aux.shape[-1] // 3
            parts = [rms_norm(c, self.fc_norm[j], self.eps) for j, c in enumerate(aux.split(ht, dim=-1))]
            aux = torch.cat(parts, dim=-1)
        elif self.input_norm is not None:
            aux = rms_norm(aux, self.input_norm, self.eps)
        return self.linear(aux.to(self.dtype), self.fc)

    def forward_rows(
        self,
        hidden: torch.Tensor,  # [B, T, H]
        tokens: torch.Tensor,  # [B, T] target-vocabulary ids
        pos: torch.Tensor,  # [B, T]
        slots: torch.Tensor,  # [B, T] slots of each row's own cache
        mask: torch.Tensor,  # bool [B, T, S]
        k_rows: torch.Tensor,  # [B, n_kv, S, hd]: one drafter cache per row (`eagle3.fast.rows`)
        v_rows: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],  # (cos, signed sin) [S, hd] from `rope_table`
        paths: tuple[torch.Tensor, torch.Tensor] | None = None,  # (length [B], tail [B, T, W]): `mask` unused
    ) -> torch.Tensor:
        """The pre-norm drafter output [B, T, H] (as `Eagle3Drafter.forward`) for B rows, each with its own cache.
        With `paths` (after
        `use_paths_attention`) each token attends by position (`eagle3.fast.split_attention.Paths`) instead of by
        `mask`."""
        b, t, _ = hidden.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        rows = torch.arange(b, device=hidden.device)[:, None]  # [B, 1]
        emb = F.embedding(tokens, self.embed).to(hidden.dtype)  # [B, T, H]
        normed = rms_norm(hidden, self.hidden_norm, self.eps)
        residual = normed if self.norm_before_residual else hidden
        u = torch.cat([rms_norm(emb, self.input_layernorm, self.eps), normed], dim=-1)  # [B, T, 2H]
        qkv = self.linear(u, self.wqkv, self.bqkv)  # [B, T, (nh + 2·nkv)·hd]
        cos, sin = rope[0][pos.reshape(-1)], rope[1][pos.reshape(-1)]  # [B·T, hd]
        q = apply_rope(qkv[..., : nh * hd].reshape(b * t, nh, hd), cos, sin)
        k = apply_rope(qkv[..., nh * hd : (nh + nkv) * hd].reshape(b * t, nkv, hd), cos, sin)
        k_rows[rows, :, slots] = k.view(b, t, nkv, hd)
        v_rows[rows, :, slots] = qkv[..., (nh + nkv) * hd :].reshape(b, t, nkv, hd)
        if paths is not None:  # q as [B, n_kv, g·T, hd]: row r·T + t is head kv·g + r
            qg = q.view(b, t, nkv, nh // nkv, hd).permute(0, 2, 3, 1, 4).reshape(b, nkv, -1, hd)
            o = self.paths_op(qg, k_rows, v_rows, paths[0], paths[1], pos, self.scale)  # [B, T, nh·hd]
        else:
            bias = row_attention_bias(mask, nh // nkv, self.dtype)  # [B, 1, g·T, S]
            o = row_attention(q.view(b, t, nh, hd), k_rows, v_rows, bias, self.scale).view(b, t, nh * hd)
        r1 = residual + self.linear(o, self.wo, self.bo)
        gate, up = self.linear(rms_norm(r1, self.post_ln, self.eps), self.w13, self.b13).chunk(2, dim=-1)
        return r1 + self.linear(F.silu(gate) * up, self.w2, self.b2)  # [B, T, H]

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [T, Vd] (the drafter's dtype) of pre-norm outputs [T, H]."""
        return self.linear(rms_norm(out, self.norm, self.eps), self.lm_head)

    def log_probs(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary log-probabilities [T, Vd] (fp32) of pre-norm outputs [T, H]."""
        return torch.log_softmax(self.logits(out).float(), dim=-1)

    def top_k(self, out: torch.Tensor, k: int, op=None, ranked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best draft tokens after each pre-norm output out [..., H]: their log-probabilities [..., k] (fp32,
        descending) and draft-vocabulary ids [..., k]; by the Triton kernels `op` (`draft_top_k_op_for`, over the
        outputs flattened to rows) where given, else `top_k_last` (`ranked`: see `ranked_top_k`)."""
        if op is None:
            return top_k_last(self.log_probs(out), k, ranked)
        logits = self.logits(out)  # [..., Vd]
        lp, ids = op(logits.reshape(-1, logits.shape[-1]), k)  # [rows, k] each
        return lp.view(*out.shape[:-1], k), ids.view(*out.shape[:-1], k)

    def feedback(self, out: torch.Tensor) -> torch.Tensor:
        """The hidden state fed to the next draft step (pre-norm, or post-norm with `norm_output`)."""
        return rms_norm(out, self.norm, self.eps) if self.norm_output else out

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def mismatch(self, drafter: Eagle3Drafter) -> str | None:
        """Why `drafter`'s weights cannot replace these in place (`load_weights`), or None where they can: the same
        shapes, dtypes and layer options, the same token embedding and RoPE."""
        return self._mismatch(FastDrafter(drafter))

    def _mismatch(self, new: FastDrafter) -> str | None:
        for attr in ("nh", "nkv", "hd", "hidden_size", "eps", "norm_before_residual", "norm_output", "dtype"):
            if getattr(new, attr) != getattr(self, attr):
                return f"its {attr} is {getattr(new, attr)}, not {getattr(self, attr)}"
        for name in WEIGHTS:
            mine, theirs = getattr(self, name), getattr(new, name)
            same = (mine is None) == (theirs is None) and (
                mine is None or (mine.shape, mine.dtype) == (theirs.shape, theirs.dtype))
            if not same:
                return f"its {name} has another shape"
        if not torch.equal(new.embed, self.embed):
            return "it embeds tokens with other weights"
        if not all(torch.equal(a, b) for a, b in zip(new.rope_table(8), self.rope_table(8), strict=True)):
            return "it has other RoPE settings"
        return None

    @torch.no_grad()
    def load_weights(self, drafter: Eagle3Drafter) -> None:
        """Take `drafter`'s weights into this drafter's own tensors (`WEIGHTS`), so that CUDA graphs captured and
        pieces compiled on them draft with the new drafter: a drafter swap on a running server. `mismatch` must
        be None. The drafter these tensors were built from shared its unfused ones; it gets copies of them first,
        so it keeps its own weights (the server keeps it to roll back to). Emitted tokens never depend on it."""
        new = FastDrafter(drafter)
        why = self._mismatch(new)
        if why is not None:
            raise ConfigError(f"this drafter cannot be loaded in place: {why}")
        self._load(new)

    def _load(self, new: FastDrafter) -> None:
        """`load_weights` of a checked candidate `new` (`_mismatch` None)."""
        written = {getattr(self, n).data_ptr() for n in WEIGHTS if getattr(self, n) is not None}
        for source in self._source:
            for module in source.modules():
                for tensors in (module._parameters, module._buffers):
                    for name, t in tensors.items():
                        if t is not None and t.data_ptr() in written:
                            if isinstance(t, nn.Parameter):
                                t.data = t.data.clone()
                            else:
                                tensors[name] = t.clone()
        self._source = []
        for name in WEIGHTS:
            mine = getattr(self, name)
            if mine is not None:
                mine.copy_(getattr(new, name))
        self.config = new.config
        if self.packed is not None:  # CPU packed copies (never captured in graphs)
            self.packed = self._pack()


def load_in_place(fast: list[FastDrafter], drafter: Eagle3Drafter) -> str | None:
    """Write `drafter`'s weights into every one of `fast` (`FastDrafter.load_weights`), its fused tensors built
    once for all; or change none and return why one of them cannot take them (`FastDrafter.mismatch`)."""
    if not fast:
        return None
    new = FastDrafter(drafter)
    why = next((w for w in (fd._mismatch(new) for fd in fast) if w is not None), None)
    if why is None:
        for fd in fast:
            fd._load(new)
    return why
