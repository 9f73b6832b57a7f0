"""A compact functional forward for Llama/Mistral/Qwen2/Qwen3 targets, and Qwen3-MoE/Mixtral (their routed experts:
`eagle3.fast.moe`), over a preallocated, position-indexed KV cache.

The weights are read from the loaded HF model (no modeling file is copied): q/k/v and gate/up are fused into one
matrix each (a copy; the rest are shared), RoPE cos/sin come from the model's own rotary module evaluated once for
every cache slot (so every static HF rope type is honoured). The KV cache is one tensor per K and V,
`[L, n_kv, S, hd]`, written at slot indices with `index_copy_`; attention always reads all S slots and a
`[T, S]` boolean mask says which are visible, so every shape is static and the forward can be captured in a CUDA
graph (the habit of pytorch-labs/gpt-fast `model.py`: `KVCache.update` writes by `input_pos`).

GQA without copying K/V: the g = n_heads / n_kv query heads that share a KV head are stacked along the query axis,
`q [n_kv, g·T, hd]` against `k [n_kv, S, hd]`, with the `[T, S]` mask tiled g times (`eagle3.fast.attention`).

Aux features (EAGLE-3): id k is HF `hidden_states[k]`, the residual stream entering decoder layer k; k = L is the
input of the final norm.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.attention import shapes_vary
from eagle3.config import ConfigError
from eagle3.fast import split_attention as split
from eagle3.fast.attention import (
    row_attention,
    row_attention_bias,
    target_attention_for,
)
from eagle3.fast.cpu import argmax_ids, exact_rows, pack_weights
from eagle3.fast.cpu import cpu_has_bf16 as cpu_has_bf16  # re-exported for eagle3.demo, eagle3.defaults
from eagle3.fast.families import _Layer, _text_config, attention_window, fast_support
from eagle3.fast.norm_fold import scale_rows, scaled_gate
from eagle3.fast.pointwise import (
    EAGER,
    Pointwise,
    fuse_level,
    residual_in_gemm,
    rms_norm,
    rope_tables,
)
from eagle3.fast.rope_cache import rope_into_rows
from eagle3.fast.row_argmax import argmax_rows
from eagle3.fast.row_norm import rms_norm_rows

log = logging.getLogger("eagle3.fast")

STEP_ROWS = 64  # tokens a batch-invariant decoding forward is padded to: trees of up to 63 nodes


class FastTarget(nn.Module):
    """The target's fused weights; `forward_rows` runs B rows of T tokens at given positions over each row's own
    static KV cache (`eagle3.fast.rows`)."""

    def __init__(self, model: nn.Module, aux_layer_ids: list[int] | None = None):
        super().__init__()
        reason = fast_support(model)
        if reason is not None:
            raise ConfigError(f"this target cannot use the fast path: {reason}; use the generic engine")
        cfg = _text_config(model)
        base = model.model
        self.num_layers = len(base.layers)
        self.nh = cfg.num_attention_heads
        self.nkv = getattr(cfg, "num_key_value_heads", None) or self.nh
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.hidden_size = cfg.hidden_size
        self.eps = float(cfg.rms_norm_eps)
        self.scale = float(getattr(base.layers[0].self_attn, "scaling", self.hd**-0.5))
        self.window = attention_window(cfg)  # every layer's sliding window (`windowed`), or None
        self.aux_layer_ids = sorted(aux_layer_ids or [])
        for k in self.aux_layer_ids:
            if not 0 <= k <= self.num_layers:
                raise ConfigError(f"aux layer id {k} is out of range (0..{self.num_layers}) for this target")
        self.layers = nn.ModuleList([_Layer(layer) for layer in base.layers])
        self.register_buffer("embed", model.get_input_embeddings().weight.detach(), persistent=False)
        self.register_buffer("norm", base.norm.weight.detach(), persistent=False)
        self.register_buffer("lm_head", model.get_output_embeddings().weight.detach(), persistent=False)
        self._rotary = [base.rotary_emb]  # a list, so it is not registered as a submodule
        self.dtype = self.embed.dtype
        self.vocab_size = self.lm_head.shape[0]
        self.pointwise = EAGER
        self.exact_rows = exact_rows(self.device, self.dtype)
        # decoding forwards that attend by `Paths` are padded to this many tokens (`forward_rows`; 0: none), so that
        # every product runs the same kernels whatever the forward holds (`FastOptions.batch_invariant`)
        self.step_rows = 0
        self.residual_in_gemm = residual_in_gemm(self.device)  # set before capturing graphs
        self.packed = pack_weights(self.device, self.dtype, self.matrices())  # `cpu_packs_weights`
        self.experts_on_host = self.device.type == "cpu"  # routed experts grouped on the host (`eagle3.fast.moe`)
        # How decoding forwards attend (`target_attention_for`, `use_attention`): split on CUDA, else SDPA (two
        # batched products with `exact_rows`)
        self.attention = target_attention_for("auto", self.device, self.hd)
        # "auto" | "fold" | "on" | "off": the layers' RMSNorms folded into their products (`eagle3.fast.norm_fold`),
        # or by `eagle3.fast.row_norm`, or torch's (`select_norm`)
        self.norm_kernel = "auto"
        # whether the q/k/v and gate/up matrices hold their norms' weights (`select_norm`); not with biases there
        self.folded = False
        self.foldable = all(lw.bqkv is None and lw.b13 is None and lw.moe is None for lw in self.layers)
        self.select_norm()

    @torch.no_grad()
    def reload_weights(self) -> None:
        """Take the model's weights again after they changed in place (`model.load_state_dict`, an RL policy
        step): the fused copies are rewritten in their own tensors, so every engine sharing this target, and the
        CUDA graphs captured on it, decode with the new weights. The other weights are the model's tensors."""
        for lw in self.layers:
            lw.refresh(self.folded)
        if self.packed is not None:  # CPU packed copies (never captured in graphs)
            self.packed = pack_weights(self.device, self.dtype, self.matrices())

    def matrices(self) -> list[torch.Tensor]:
        """The weight matrices of the products: each layer's four (with experts: two, the router and each
        expert's two), then the lm_head."""
        dense = [m for lw in self.layers for m in (lw.wqkv, lw.wo, lw.w13, lw.w2) if m is not None]
        return dense + [m for lw in self.layers if lw.moe is not None for m in lw.moe.matrices()] + [self.lm_head]

    def use_norm_kernel(self) -> None:
        """Run the RMSNorms through `eagle3.fast.row_norm` (one Triton program per row) whatever the attention
        (`scripts/profile_step.py --target-norm triton`); call after `fuse_pointwise` and before capturing graphs
        (CUDA only). By default they do so where the target attends by splits (`select_norm`)."""
        if self.device.type != "cuda":
            raise ConfigError("the Triton RMSNorm runs on CUDA only")
        self.norm_kernel = "on"
        self.select_norm()

    def select_norm(self) -> None:
        """Set the RMSNorms of every forward, as `norm_kernel` says; call before capturing graphs.

        Folded ("fold", or "auto" where the target attends by splits, the Triton decoding path, whose RoPE
        kernel applies the scale): each layer's two norm weights go into its q/k/v and gate/up matrices and the
        kernels after those products apply the rows' scale (`eagle3.fast.norm_fold`); not where those products
        have biases (Qwen2) or the layer has routed experts. The final norm, and every norm otherwise, is
        `eagle3.fast.row_norm` ("on", or "auto"/"fold" on that path, where it is faster than `F.rms_norm`), else
        `rms_norm`."""
        if self.norm_kernel not in ("auto", "fold", "on", "off"):
            raise ConfigError(f"norm_kernel {self.norm_kernel!r}: expected auto, fold, on or off")
        if self.norm_kernel == "fold" and not self.foldable:
            raise ConfigError("the norms cannot be folded into this target's products: its q/k/v or gate/up "
                              "projections have biases, or its layers have routed experts")
        decoding_path = self.attention == "split"
        fold = self.norm_kernel == "fold" or (self.norm_kernel == "auto" and decoding_path and self.foldable)
        if fold != self.folded:
            for lw in self.layers:
                lw.fuse(folded=fold)
            self.folded = fold
            if self.packed is not None:  # the packed copies are of the matrices just replaced
                self.packed = pack_weights(self.device, self.dtype, self.matrices())
        on = self.norm_kernel == "on" or (self.norm_kernel in ("auto", "fold") and decoding_path)
        want = rms_norm_rows if on else rms_norm
        if self.pointwise.norm is not want:
            self.pointwise = copy.copy(self.pointwise)  # EAGER is shared by every target
            self.pointwise.norm = want

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy ids [T] of logits [T, V]: by `eagle3.fast.row_argmax` where the target attends by splits, else
        `argmax_ids` (the same ids)."""
        if self.attention == "split":
            return argmax_rows(logits)
        return argmax_ids(logits)

    def use_attention(self, choice: str | None) -> str:
        """Attend in decoding forwards as `choice` says (`target_attention_for`; call before capturing graphs),
        with the norms that go with it (`select_norm`); returns what it resolved to."""
        self.attention = target_attention_for(choice, self.device, self.hd)
        self.select_norm()
        return self.attention

    def fuse_pointwise(self, backend: str = "inductor", level: bool | str | None = "elementwise") -> None:
        """Run RoPE and SwiGLU as compiled kernels from now on (`Pointwise`; `level` as `fuse_level`: "off", or
        "auto" off CUDA, leaves everything as it is); compiles on first use, so call it before capturing graphs."""
        level = fuse_level(level, self.device)
        if level is None:
            return
        if self.device.type != "cuda":
            # Without CUDA graphs every compiled call pays its guard checks in Python, about 120 per step, which
            # makes CPU decoding slower (docs/benchmarks.md).
            log.warning("fuse_pointwise on %s: compiled pieces are not captured in graphs here, and their call "
                        "overhead makes decoding slower; it is meant for CUDA", self.device)
        self.pointwise = Pointwise(backend)
        self.select_norm()

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @torch.no_grad()
    def rope_table(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [S, hd] for positions 0..seq_len-1, from the model's own rotary module."""
        dev, dt = self.device, self.dtype
        pos = torch.arange(seq_len, device=dev)[None]  # [1, S]
        cos, sin = self._rotary[0](torch.zeros(1, dtype=dt, device=dev), pos)  # [1, S, hd] each
        return rope_tables(cos[0].to(dt), sin[0].to(dt))

    def rope_qk(self, qkv: torch.Tensor, lw: _Layer, cos: torch.Tensor, sin: torch.Tensor):
        """Fused projections qkv [N, (nh + 2·nkv)·hd] -> RoPE'd q [N, nh, hd] and k [N, nkv, hd] (Qwen3: RMSNorm
        over head_dim first), tokens first; cos/sin [N, hd]."""
        n, nh, nkv, hd = qkv.shape[0], self.nh, self.nkv, self.hd
        pw = self.pointwise
        if lw.q_norm is None:  # RoPE on q and k at once: they are adjacent in the fused output
            qk = pw.rope(qkv[:, : (nh + nkv) * hd].view(n, nh + nkv, hd), cos, sin)
            return qk[:, :nh], qk[:, nh:]
        q = pw.rope(pw.norm(qkv[:, : nh * hd].view(n, nh, hd), lw.q_norm, self.eps), cos, sin)
        k = pw.rope(pw.norm(qkv[:, nh * hd : (nh + nkv) * hd].view(n, nkv, hd), lw.k_norm, self.eps), cos, sin)
        return q, k

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear`, over a packed copy of `w` where this target packs its weights (`cpu_packs_weights`)."""
        return F.linear(x, w, b) if self.packed is None else self.packed.linear(x, w, b)

    def qkv(self, h: torch.Tensor, lw: _Layer) -> torch.Tensor:
        """Layer lw's fused q/k/v projections [N, (nh + 2·nkv)·hd] of its input h [N, H] (normed first, or, with
        folded norms, scaled after: `eagle3.fast.norm_fold`), for the PyTorch paths that norm every layer anew."""
        if self.folded:
            return scale_rows(self.linear(h, lw.wqkv), h, self.eps)
        return self.linear(self.pointwise.norm(h, lw.ln1, self.eps), lw.wqkv, lw.bqkv)

    def gated(self, x: torch.Tensor, lw: _Layer) -> torch.Tensor:
        """silu(gate) * up of the normed x [N, H] -> [N, I]: the MLP's input to its down projection. With folded
        norms x is the residual h itself, whose scale the activation applies (`eagle3.fast.norm_fold`)."""
        if self.folded:
            return scaled_gate(self.linear(x, lw.w13), x, self.eps)
        return self.pointwise.gate(self.linear(x, lw.w13, lw.b13))

    def experts(self, x: torch.Tensor, lw: _Layer) -> torch.Tensor:
        """Layer lw's routed experts on the normed x [N, H] -> [N, H] (`eagle3.fast.moe`)."""
        on_host = self.experts_on_host and not torch.compiler.is_compiling()  # not in traced code
        return lw.moe(x, self.linear, self.pointwise.gate, on_host=on_host, min_rows=2 if self.exact_rows else 1)

    def _adds_in_product(self, b: torch.Tensor | None) -> bool:
        """Whether a residual add goes into the epilogue of a product with bias `b` (`residual_in_gemm`; a bias
        keeps the add after the product)."""
        return self.residual_in_gemm and b is None

    def add_linear(self, h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """The residual h [N, H] plus the product x [N, K] · wᵀ (+ b): in the product's epilogue where
        `_adds_in_product`, else added after it."""
        if self._adds_in_product(b):
            return h.addmm_(x, w.t())  # in place: out-of-place addmm first copies h into its result
        return h + self.linear(x, w, b)

    def add_linear_norm(
        self, h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, norm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_linear` and the RMSNorm (weight `norm`) after it: (h', norm(h')), [N, H] each. Without the add in
        the product the add and the norm are one piece (`Pointwise.add_norm`: one kernel when all are fused)."""
        if self._adds_in_product(b):
            h = h.addmm_(x, w.t())
            return h, self.pointwise.norm(h, norm, self.eps)
        return self.pointwise.add_norm(h, self.linear(x, w, b), norm, self.eps)

    def post_attention(
        self, i: int, h: torch.Tensor, o: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer i after its attention: the output projection of `o` (attention output [N, nh·hd]) and its
        residual add, the MLP and its residual add, then the next norm (layer i+1's input norm, or the final norm
        after the last layer). Returns h [N, H] and that norm of it [N, H]; with folded norms, None instead of
        layer i+1's input norm (its products read h and scale their outputs, `eagle3.fast.norm_fold`)."""
        lw = self.layers[i]
        last = i + 1 == self.num_layers
        if self.folded:
            h = self.add_linear(h, o, lw.wo, lw.bo)
            if not last:
                return self.add_linear(h, self.gated(h, lw), lw.w2, lw.b2), None
            return self.add_linear_norm(h, self.gated(h, lw), lw.w2, lw.b2, self.norm)
        h, x = self.add_linear_norm(h, o, lw.wo, lw.bo, lw.ln2)
        after = self.norm if last else self.layers[i + 1].ln1
        if lw.moe is not None:
            return self.pointwise.add_norm(h, self.experts(x, lw), after, self.eps)
        return self.add_linear_norm(h, self.gated(x, lw), lw.w2, lw.b2, after)

    def weight_bytes(self) -> int:
        """Bytes read per decoding step for weights: layers (of routed experts, the router and k experts),
        final norm and lm_head (the embedding table is read one row at a time, so it counts only when it is the
        lm_head too)."""
        n = sum(b.numel() * b.element_size() for layer in self.layers for b in layer.buffers(recurse=False))
        n += sum(layer.moe.active_bytes() for layer in self.layers if layer.moe is not None)
        return n + self.norm.numel() * self.norm.element_size() + self.lm_head.numel() * self.lm_head.element_size()

    def kv_bytes(self, context: int) -> int:
        """K and V bytes of `context` cached positions over all layers."""
        return 2 * self.num_layers * self.nkv * context * self.hd * self.dtype.itemsize

    # -- forward -------------------------------------------------------------------------------
    def windowed(self, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """`mask` [..., T, S] less the slots outside the sliding window of the tokens at positions `pos` [..., T].
        Slot s of the prefix holds position s; a draft tree's own slots lie above its positions, within any
        window longer than the tree is deep, so the slot index stands for the position."""
        if self.window is None:
            return mask
        slots = torch.arange(mask.shape[-1], device=mask.device)  # [S]
        return mask & (slots > pos[..., None] - self.window)

    def by_splits(self, t: int) -> bool:
        """Whether a forward of t tokens attends by the split kernel: where it was chosen and takes t tokens, in
        fixed-shape code (traced code, torch.compile's, and varying shapes attend by SDPA)."""
        return (self.attention == "split" and not shapes_vary() and split.supports(self.hd, max(t, self.step_rows))
                and not torch.compiler.is_compiling())

    def forward_rows(
        self,
        ids: torch.Tensor,  # [B, T] long
        pos: torch.Tensor,  # [B, T] long, RoPE positions
        slots: torch.Tensor,  # [B, T] long, slots of each row's own cache
        mask: torch.Tensor | None,  # bool [B, T, S] (None: `path` only, where the split attention runs)
        k_rows: torch.Tensor,  # [L, B, n_kv, S, hd]: one cache per row (`eagle3.fast.rows`)
        v_rows: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],  # (cos, signed sin) [S, hd] from `rope_table`
        logits_at: torch.Tensor | None = None,  # [B] one position per row (prefill: each prompt's last token)
        want_aux: bool = False,
        path: tuple[torch.Tensor, torch.Tensor] | None = None,  # decoding forwards: (length [B], tail [B, T, W])
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """B rows of T tokens, each row over its own cache: logits [B, T, V] in the model dtype ([B, 1, V] at
        `logits_at`) and aux features [B, T, 3·H] (None unless want_aux). With `path` (decoding forwards), where
        the split attention runs, each token attends by position over its row's committed prefix and its own path
        (`eagle3.fast.split_attention.Paths`), so a tree's accepted nodes sum what plain decoding's one-token steps
        sum; with `step_rows` (batch-invariant) such forwards are also padded to that many tokens, so that every
        product has one shape whatever the forward holds. Elsewhere tokens attend by `mask`."""
        b, t = ids.shape
        pad = self.step_rows - t if path is not None and self.by_splits(t) else 0
        if pad > 0:  # batch-invariant: every decoding forward at `step_rows` tokens, padded with the last one
            def padded(x: torch.Tensor) -> torch.Tensor:  # [B, T, ...] -> [B, step_rows, ...]
                return torch.cat([x, x[:, -1:].expand(b, pad, *x.shape[2:])], dim=1)

            logits, aux = self.forward_rows(padded(ids), padded(pos), padded(slots), None, k_rows, v_rows, rope,
                                            logits_at, want_aux, (path[0], padded(path[1])))
            return logits[:, :t], None if aux is None else aux[:, :t]  # padding writes its last token's K/V again
        if b * t == 1 and self.exact_rows:  # one token as two equal ones: the many-row kernels' bits (`exact_rows`)
            logits, aux = self.forward_rows(
                ids.repeat(1, 2), pos.repeat(1, 2), slots.repeat(1, 2), None if mask is None else mask.repeat(1, 2, 1),
                k_rows, v_rows, rope, logits_at, want_aux, None if path is None else (path[0], path[1].repeat(1, 2, 1)))
            return logits[:, :1], None if aux is None else aux[:, :1]
        nh, nkv, hd = self.nh, self.nkv, self.hd
        g = nh // nkv
        rows = torch.arange(b, device=ids.device)[:, None]  # [B, 1]
        h = F.embedding(ids.reshape(-1), self.embed)  # [B·T, H]
        paths = split.Paths(path[0], path[1], pos) if path is not None and self.by_splits(t) else None
        if paths is None:
            cos, sin = rope[0][pos.reshape(-1)], rope[1][pos.reshape(-1)]  # [B·T, hd]
        # [B, 1, g·T, S] where the rows attend by mask
        bias = None if paths is not None else row_attention_bias(self.windowed(mask, pos), g, self.dtype)
        aux: list[torch.Tensor] = []
        folded = self.folded
        x = None if folded else self.pointwise.norm(h, self.layers[0].ln1, self.eps)  # [B·T, H]
        for i, lw in enumerate(self.layers):
            if want_aux and i in self.aux_layer_ids:
                aux.append(h.clone() if self.residual_in_gemm else h)  # h changes in place
            qkv = self.linear(h if folded else x, lw.wqkv, lw.bqkv)  # [B·T, (nh + 2·nkv)·hd]
            if paths is not None:  # one kernel rotates q and k and writes each row's K and V (`rope_into_rows`)
                q = rope_into_rows(qkv, rope[0], rope[1], pos, slots, k_rows[i], v_rows[i], nh,
                                   None if lw.q_norm is None else (lw.q_norm, lw.k_norm), self.eps,
                                   rms=h if folded else None)  # [B, nh, T, hd]
                # q as [B, n_kv, g·T, hd] (a view): row r·T + t is head kv·g + r
                o = split.split_attention(q.view(b, nkv, g * t, hd), k_rows[i], v_rows[i], None, self.scale,
                                          paths=paths, window=self.window).view(b * t, nh * hd)  # [B·T, nh·hd]
            else:
                if folded:
                    qkv = scale_rows(qkv, h, self.eps)
                q, k = self.rope_qk(qkv, lw, cos, sin)  # [B·T, nh, hd], [B·T, nkv, hd]
                k_rows[i][rows, :, slots] = k.view(b, t, nkv, hd)  # row b's tokens at its slots
                v_rows[i][rows, :, slots] = qkv[:, (nh + nkv) * hd :].view(b, t, nkv, hd)
                o = row_attention(q.view(b, t, nh, hd), k_rows[i], v_rows[i], bias, self.scale,
                                  self.exact_rows)  # [B·T, nh·hd]
            h, x = self.post_attention(i, h, o)
        if want_aux and self.num_layers in self.aux_layer_ids:
            aux.append(h)
        x = x.view(b, t, -1)  # the final norm of h
        if logits_at is not None:
            x = x[rows[:, 0], logits_at][:, None]  # [B, 1, H]
        logits = self.linear(x, self.lm_head)  # [B, T', V]
        return logits, (torch.cat(aux, dim=-1).view(b, t, -1) if want_aux else None)  # aux [B, T, 3·H]
