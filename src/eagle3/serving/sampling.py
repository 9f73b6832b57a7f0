"""Position-keyed sampling for the server: each token is drawn with noise fixed by (seed, position).

The token at absolute position p of a request with seed s is `argmax_v probs[v] / E[s, p, v]`, where E are
i.i.d. Exp(1) variables computed by hashing (s, p, v). This is the exponential race (Gumbel-max in another
form; vLLM's sampler draws with the same `probs / Exp(1)` argmax, `vllm/v1/sample/ops/topk_topp_sampler.py`),
so each token is an exact draw from the processed target distribution `process_logits(...)`. It is computed as
`argmax_v scores[v] - log E[s, p, v]` on the filtered scores (logits / temperature, -inf where top-k or top-p
removed a token): the softmax's normaliser is the same for every v, so this is the same draw without a softmax.

Why key the noise by position: the noise for position p does not depend on the prefix, so verifying a draft
tree is simply greedy acceptance against these per-node choices, and the sampled text is the same whether a
request runs alone or in a batch, with or without speculation (it depends only on seed, prompt and the
target's logits). The sequence is still distributed exactly as plain sampling: the noise at p is
independent of the tokens before p. It is a different random stream from `eagle3 generate --seed`
(which samples through `torch.Generator` and the residual rule of `eagle3.decoding.verify`), so the same
seed gives different (equally distributed) text there.

The hash is Chris Wellons' `lowbias32` (public domain, github.com/skeeto/hash-prospector), evaluated in
int64 with 32-bit products split into 16-bit halves so nothing overflows; identical on CPU and CUDA.

Cost: eagerly, the noise is about 30 int64 passes over [rows, positions, V], which at 64 rows x 8 verified
positions x 49,152 tokens is gigabytes of memory traffic per cycle. `fused=True` compiles the draw with inductor
into one kernel that reads the logits once and computes the hash in registers, many times faster, with the same
tokens (`tests/test_sampling_stats.py`).
The servers use it on CUDA, where their cycles are captured graphs (compiled before capture).
"""

from __future__ import annotations

import functools
import logging

import torch

from eagle3.decoding.sampling import filter_scores, filter_scores_rows
from eagle3.fast.graphs import raise_recompile_limit

__all__ = ["exponential_noise", "exponential_noise_rows", "fused_draw_available", "hash_u32", "race_sample",
           "race_sample_rows", "seed_hash", "vocab_hash"]

log = logging.getLogger("eagle3.serving")

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for uint32 values held in int64, without int64 overflow."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def hash_u32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on uint32 values in an int64 tensor."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_hash(seed: int) -> int:
    """The per-request key of the noise: hash_u32 of the seed's low 32 bits."""
    return int(hash_u32(torch.tensor(seed & _M32, dtype=torch.long)))


def vocab_hash(vocab: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The per-token key of the noise, [V] long (the same for every request and position)."""
    return hash_u32(torch.arange(vocab, dtype=torch.long, device=device) + 0x9E3779B9)


def exponential_noise_rows(seed_hashes: torch.Tensor, positions: torch.Tensor, vocab_h: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise [R, M, V] (fp32) for positions [R, M] of R requests keyed by `seed_hashes` [R] (`seed_hash`),
    with `vocab_h` = `vocab_hash(V)`. Fixed-shape tensor ops only (CUDA-graph safe)."""
    per_pos = hash_u32(positions.long() ^ seed_hashes[:, None])  # [R, M]
    h = hash_u32(per_pos[..., None] ^ vocab_h)  # [R, M, V]
    w = (h.float() + 0.5) * (1.0 / 4294967296.0)  # [R, M, V] uniform in (0, 1)
    return -torch.log1p(-w)  # Exp(1); w rounding to 1.0 gives inf, i.e. a token that loses this draw


def exponential_noise(seed: int, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [..., V] (fp32) for `positions` [...] (long) of a request with `seed`."""
    dev = positions.device
    s = torch.tensor([seed_hash(seed)], dtype=torch.long, device=dev)
    flat = positions.reshape(1, -1)  # [1, P]
    return exponential_noise_rows(s, flat, _vocab_hash_on(vocab, dev)).reshape(*positions.shape, vocab)


@functools.lru_cache(maxsize=8)
def _vocab_hash_on(vocab: int, device: torch.device) -> torch.Tensor:
    """`vocab_hash`, computed once per vocabulary size and device (the per-request draws need it every cycle)."""
    return vocab_hash(vocab, device)


def race_sample(
    logits: torch.Tensor,  # [M, V] raw target logits of one request
    positions: torch.Tensor,  # [M] absolute position of the token each row predicts
    seed: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    fused: bool = False,
) -> torch.Tensor:
    """The sampled token id for each row [M] (long): argmax of processed probs / position-keyed Exp(1).
    `fused`: the compiled draw of `race_sample_rows` (the same tokens, one kernel)."""
    if fused:
        dev = logits.device
        return race_sample_rows(
            logits[None], positions[None], torch.tensor([seed_hash(seed)], device=dev),
            torch.tensor([float(temperature)], device=dev), torch.tensor([float(top_p)], device=dev),
            torch.tensor([int(top_k)], device=dev), _vocab_hash_on(logits.shape[-1], dev),
            filters=top_p < 1.0 or top_k > 0, fused=True,
        )[0]
    scores = filter_scores(logits, temperature, top_p, top_k)  # [M, V]
    return (scores - exponential_noise(seed, positions, scores.shape[-1]).log()).argmax(dim=-1)


def _draw_rows(
    logits: torch.Tensor,  # [R, M, V] raw logits
    scores: torch.Tensor | None,  # [R, M, V] filtered fp32 scores, or None: logits / temperature
    positions: torch.Tensor,  # [R, M]
    seed_hashes: torch.Tensor,  # [R]
    temperature: torch.Tensor,  # [R]
    vocab_h: torch.Tensor,  # [V]
) -> torch.Tensor:
    """The race over `scores` for sampled rows, argmax of `logits` for rows at temperature 0: [R, M] long."""
    if scores is None:
        scores = logits.float() / temperature.clamp(min=1e-6)[:, None, None]  # [R, M, V]
    drawn = (scores - exponential_noise_rows(seed_hashes, positions, vocab_h).log()).argmax(dim=-1)  # [R, M]
    return torch.where((temperature > 0)[:, None], drawn, logits.argmax(dim=-1))


_fused_draw = None  # the compiled `_draw_rows`, built on first use; False after it failed once


def _compiled_draw():
    global _fused_draw
    if _fused_draw is None:
        # shapes vary by rows (1 or more), positions (1 or more) and scores (None or given): up to 8 graphs
        raise_recompile_limit()
        _fused_draw = torch.compile(_draw_rows, dynamic=True, fullgraph=True)
    return _fused_draw


def fused_draw_available() -> bool:
    """False once compiling the fused draw has failed in this process (every draw is eager from then on)."""
    return _fused_draw is not False


def race_sample_rows(
    logits: torch.Tensor,  # [R, M, V] raw target logits, M positions of each of R requests
    positions: torch.Tensor,  # [R, M] absolute position of the token each predicts
    seed_hashes: torch.Tensor,  # [R] long, `seed_hash(seed)` per request
    temperature: torch.Tensor,  # [R] fp32; 0 = greedy
    top_p: torch.Tensor,  # [R] fp32
    top_k: torch.Tensor,  # [R] long
    vocab_h: torch.Tensor,  # [V] `vocab_hash(V)`
    filters: bool = True,  # False: no row uses top-p or top-k (skips two sorts over the vocabulary)
    fused: bool = False,  # the draw compiled into one kernel (see the module docstring); eager if that fails
) -> torch.Tensor:
    """`race_sample` for R requests at once, each with its own settings, and argmax for rows at temperature 0:
    token ids [R, M] (long), equal to the per-request calls (tests/test_sampling_stats.py). Fixed-shape tensor
    ops only, so a batched decoding step that mixes greedy and sampled requests can be captured as a CUDA graph
    (a fused draw is compiled by its first call, so callers warm up before they capture)."""
    global _fused_draw
    scores = filter_scores_rows(logits, temperature, top_p, top_k) if filters else None  # [R, M, V]
    if fused and fused_draw_available():
        try:
            return _compiled_draw()(logits, scores, positions, seed_hashes, temperature, vocab_h)
        except Exception as e:  # inductor can fail in many ways; sampling goes on eagerly
            log.warning("compiling the fused sampling draw failed (%s: %s); sampling eagerly from now on",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            _fused_draw = False
    return _draw_rows(logits, scores, positions, seed_hashes, temperature, vocab_h)
