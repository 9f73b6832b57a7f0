"""The one sampler: a request's sampling settings become filtered scores, and each token is a position-keyed draw.

`filter_scores` applies temperature, then top-k, then top-p (nucleus) filtering, in the order and with the tie
and "keep at least one token" rules of Hugging Face's `TemperatureLogitsWarper`, `TopKLogitsWarper` and
`TopPLogitsWarper` (transformers `src/transformers/generation/logits_process.py`; order from
`GenerationMixin._get_logits_processor`); `filter_scores_rows` does the same with each row's own settings.

The token at absolute position p of a request with seed s is `argmax_v probs[v] / E[s, p, v]`, where E are
i.i.d. Exp(1) variables computed by hashing (s, p, v): the exponential race (Gumbel-max in another form; vLLM's
sampler draws with the same `probs / Exp(1)` argmax, `vllm/v1/sample/ops/topk_topp_sampler.py`), so each token
is an exact draw from the processed target distribution. It is computed as `argmax_v scores[v] - log E[s, p, v]`
on the filtered scores: the softmax's normaliser is the same for every v, so this is the same draw without a
softmax. Temperature 0 is the argmax.

Why key the noise by position: the noise for position p does not depend on the prefix, so the target's choice
after every node of a draft tree is fixed before verification, and verifying is "accept the draft where it
equals the target's choice after its parent" (`eagle3.decoding.verify.accept`), for greedy and sampled requests
alike. A request's text then depends only on its seed, prompt and the target's logits: the same with or without
speculation, alone or in a batch, from `eagle3 generate` or the server. The sequence is distributed exactly as
plain sampling, since the noise at p is independent of the tokens before p.

The hash is Chris Wellons' `lowbias32` (public domain, github.com/skeeto/hash-prospector), evaluated in int64
with 32-bit products split into 16-bit halves so nothing overflows; identical on CPU and CUDA. Eagerly the noise
is about 30 int64 passes over [rows, positions, V]; `fused=True` compiles the draw into one kernel that reads the
logits once and computes the hash in registers (the same tokens).
"""

from __future__ import annotations

import functools
import logging
import secrets

import torch

from eagle3.config import SamplingConfig

__all__ = ["FILTERED", "GREEDY", "MODES", "TEMPERATURE", "SamplingRows", "choose", "coupled_draft_scores",
           "exponential_noise", "exponential_noise_rows", "filter_scores", "filter_scores_rows", "fused_draw_available",
           "hash_u32", "new_seed", "process_logits", "race_sample", "race_sample_rows", "sampling_mode", "seed_hash",
           "token_hash", "vocab_hash"]

log = logging.getLogger("eagle3.decoding")

# How a row chooses its tokens; captured cycles exist per mode (a bucket runs the largest of its rows' modes)
GREEDY, TEMPERATURE, FILTERED = 0, 1, 2
MODES = (GREEDY, TEMPERATURE, FILTERED)


def sampling_mode(temperature: float, top_p: float = 1.0, top_k: int = 0) -> int:
    """GREEDY (temperature 0), TEMPERATURE (sampled, no top-p / top-k) or FILTERED."""
    if temperature == 0:
        return GREEDY
    return TEMPERATURE if top_p >= 1.0 and top_k == 0 else FILTERED

def filter_scores(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Scores (fp32 logits / temperature, same shape as `logits`) with -inf on the tokens top-k and top-p
    remove: `process_logits` before its softmax (see there for the rules)."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: process_logits needs temperature > 0 (0 means greedy)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 disables it)")
    scores = logits.float() / temperature  # [..., V]
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)  # [..., V] ascending
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # [..., V]
        remove_sorted = cum <= (1.0 - top_p)  # [..., V]
        remove_sorted[..., -1] = False  # the most likely token always stays
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)  # [..., V] back in vocab order
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def process_logits(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Probabilities (fp32, same shape as `logits`, summing to 1 over the last dim) after filtering: what a
    request's draws follow (`race_sample`).

    `temperature` must be > 0 (temperature 0 is greedy and never reaches here). `top_k=0` and `top_p=1`
    disable the filters. Top-k keeps every token tied with the k-th largest logit (as HF does); top-p
    removes the lowest-probability tokens whose cumulative mass is <= 1 - top_p and always keeps the most
    likely token, so at least one token survives.
    """
    return filter_scores(logits, temperature, top_p, top_k).softmax(dim=-1)


def filter_scores_rows(
    logits: torch.Tensor,  # [R, M, V]: M positions of each of R requests
    temperature: torch.Tensor,  # [R] fp32, > 0 (rows at 0 get arbitrary scores: callers take the argmax)
    top_p: torch.Tensor,  # [R] fp32 in (0, 1]
    top_k: torch.Tensor,  # [R] long, 0 = off
    filters: bool = True,
) -> torch.Tensor:
    """`filter_scores` with each row's own settings, as fixed-shape tensor ops (no host sync, CUDA-graph safe):
    scores [R, M, V] equal to `filter_scores(logits[r], temperature[r], top_p[r], top_k[r])` row by row
    (tests/test_sampling_stats.py). A filter a row turns off leaves its scores untouched, as there.
    `filters=False` skips both filters (and their two sorts over the vocabulary): only for rows that all have
    top_p 1 and top_k 0."""
    r, m, vocab = logits.shape
    scores = logits.float() / temperature.clamp(min=1e-6)[:, None, None]  # [R, M, V]
    if not filters:
        return scores
    desc = torch.sort(scores, dim=-1, descending=True).values  # [R, M, V]
    kth = desc.gather(-1, (top_k - 1).clamp(0, vocab - 1)[:, None, None].expand(r, m, 1))  # [R, M, 1] k-th largest
    use_k = ((top_k > 0) & (top_k < vocab))[:, None, None]  # [R, 1, 1]
    scores = scores.masked_fill(use_k & (scores < kth), float("-inf"))
    sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)  # [R, M, V] ascending
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # [R, M, V]
    remove_sorted = cum <= (1.0 - top_p)[:, None, None]  # [R, M, V]
    remove_sorted[..., -1] = False  # the most likely token always stays
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)  # [R, M, V] back in vocab order
    return scores.masked_fill((top_p < 1.0)[:, None, None] & remove, float("-inf"))


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
    """The per-request key of the noise: `hash_u32` of the seed's low 32 bits, in Python integers."""
    x = seed & _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def vocab_hash(vocab: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The per-token key of the noise, [V] long (the same for every request and position)."""
    return token_hash(torch.arange(vocab, dtype=torch.long, device=device))


def token_hash(ids: torch.Tensor) -> torch.Tensor:
    """`vocab_hash` of the token ids `ids` [...] (long): the keys of a draft vocabulary's tokens."""
    return hash_u32(ids + 0x9E3779B9)


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
        from torch import _dynamo

        # shapes vary by rows (1 or more), positions (1 or more) and scores (None or given): up to 8 graphs
        _dynamo.config.recompile_limit = max(_dynamo.config.recompile_limit, 64)
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


def coupled_draft_scores(
    logits: torch.Tensor,  # [R, T, Vd] a drafter's logits: T rows of request r all drafting the token at positions[r]
    positions: torch.Tensor,  # [R] long, the absolute position of each request's drafted token
    rows: SamplingRows,  # the requests' settings, rows 0..R-1
    mode: int,  # the largest of the requests' modes: TEMPERATURE or FILTERED
    draft_h: torch.Tensor,  # [Vd] `token_hash` of the draft vocabulary's target ids
) -> tuple[torch.Tensor, torch.Tensor]:
    """Coupled drafting: (log q + G, log q), both [R, T, Vd] fp32, with q the drafter's distribution processed as
    each request's draws are (temperature, top-k, top-p) and G = -log E the Gumbel noise of the target's own draw
    at that request's position. The top k of log q + G are k draws without replacement from q (Gumbel-top-k); the
    first is coupled to the target's draw there, and equals it wherever q is close to the target's distribution,
    where the drafter's top-1 would be accepted with probability p(x) only. Greedy requests (temperature 0) get
    their plain log-probabilities in both. Fixed-shape tensor ops (CUDA-graph safe)."""
    r = logits.shape[0]
    scores = filter_scores_rows(logits, rows.temp[:r], rows.top_p[:r], rows.top_k[:r], filters=mode == FILTERED)
    sampled = (rows.temp[:r] > 0)[:, None, None]  # [R, 1, 1]
    lq = torch.where(sampled, torch.log_softmax(scores, dim=-1), torch.log_softmax(logits.float(), dim=-1))
    noise = exponential_noise_rows(rows.seed_h[:r], positions.view(r, 1), draft_h)  # [R, 1, Vd]
    return torch.where(sampled, lq - noise.log(), lq), lq


def new_seed() -> int:
    """A fresh 32-bit seed for a request that gives none (its draws are then not reproducible)."""
    return secrets.randbits(32)


def choose(
    logits: torch.Tensor,  # [M, V] raw target logits of one request
    positions: torch.Tensor,  # [M] absolute position of the token each row predicts
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    fused: bool = False,
) -> torch.Tensor:
    """The target's token after each row [M] (long): the argmax at temperature 0, else the position-keyed draw."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return race_sample(logits, positions, seed, temperature, top_p, top_k, fused=fused)


class SamplingRows:
    """Each row's sampling settings on the device, for cycles that choose tokens without a host sync (CUDA-graph
    safe): temperature [R] (0 = greedy), top_p [R], top_k [R], seed hash [R], and the vocabulary's noise keys."""

    def __init__(self, rows: int, vocab: int | None, device: torch.device | str):
        """`vocab`: the target's vocabulary size, for the draws' noise keys (None: settings only)."""
        self.temp = torch.zeros(rows, dtype=torch.float32, device=device)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(rows, dtype=torch.long, device=device)
        self.seed_h = torch.zeros(rows, dtype=torch.long, device=device)
        self.vocab_h = vocab_hash(vocab, device) if vocab is not None else None  # [V]

    def set(self, lo: int, settings: list[SamplingConfig | None]) -> None:
        """Rows lo, lo+1, ... get `settings` (None or temperature 0: greedy), in one copy per buffer."""
        hi = lo + len(settings)
        greedy = SamplingConfig()
        rows = [s if s is not None and s.temperature > 0 else greedy for s in settings]
        self.temp[lo:hi].copy_(torch.tensor([s.temperature for s in rows], dtype=torch.float32))
        self.top_p[lo:hi].copy_(torch.tensor([s.top_p for s in rows], dtype=torch.float32))
        self.top_k[lo:hi].copy_(torch.tensor([s.top_k for s in rows], dtype=torch.long))
        self.seed_h[lo:hi].copy_(torch.tensor([seed_hash(s.seed or 0) for s in rows], dtype=torch.long))

    def move(self, dst: int, src: int) -> None:
        for buf in (self.temp, self.top_p, self.top_k, self.seed_h):
            buf[dst] = buf[src]

    def draw(self, logits: torch.Tensor, positions: torch.Tensor, mode: int, fused: bool = False,
             lo: int = 0) -> torch.Tensor:
        """The token after each of logits [nb, M, V] (positions [nb, M] of the predicted tokens) for rows lo ..
        lo + nb - 1: the position-keyed draw for sampled rows, the argmax for greedy ones (`mode` FILTERED applies
        top-p and top-k; `fused` compiles the draw into one kernel). [nb, M]."""
        hi = lo + logits.shape[0]
        return race_sample_rows(logits, positions, self.seed_h[lo:hi], self.temp[lo:hi], self.top_p[lo:hi],
                                self.top_k[lo:hi], self.vocab_h, filters=mode == FILTERED, fused=fused)
