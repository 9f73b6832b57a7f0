"""`ServeConfig`: the server's limits and defaults in one dataclass (the adaptive policy is `SpecPolicy`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from eagle3.config import DEFAULT_MAX_NEW_TOKENS, ConfigError

__all__ = ["ServeConfig"]


@dataclass
class ServeConfig:
    """What `eagle3 serve` enforces; every field has a matching command-line flag."""

    model_name: str = "eagle3"  # the id in /v1/models and in every response
    max_batch_size: int = 64  # rows decoded together
    max_model_len: int | None = None  # prompt + completion tokens; None: the target's max_position_embeddings
    default_max_tokens: int = DEFAULT_MAX_NEW_TOKENS  # when a request gives no max_tokens (capped by context)
    max_prefill_tokens: int = 4096  # padded prompt tokens per batched prefill (one prompt always fits)
    max_waiting: int = 1024  # queued requests beyond which new ones get 503
    max_stop_strings: int = 4  # as OpenAI
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on shutdown
    chat_template: str | None = None  # a Jinja chat template for tokenizers without one
    fast_rows_len: int = 2048  # cache slots per fast row (prompt + completion + a cycle); longer requests: generic
    # While rows decode, a new request may wait up to this many prefill durations (measured) for others to share
    # its prefill: every prefill stalls the whole batch, and one prefill of several prompts costs about what
    # one of a single prompt does (launch-bound). 1.0 is the ski-rental rule: waiting never costs a request
    # more than the prefill it saves the batch. 0 admits at once.
    admit_wait: float = 1.0
    # A streamed request gets a chunk every this many tokens (the first and the last at once); vLLM's and SGLang's
    # `stream_interval`, default 1 there too. Larger values trade smoothness for host time at high concurrency.
    stream_interval: int = 1
    # record every finished request's token ids, sampling settings and acceptance as Parquet shards here
    # (`eagle3.traffic`; `eagle3 adapt` trains on them); a request opts out with `GenParams.record` False
    record: str | None = None
    record_shard_rows: int = 4096
    # the bearer token of the /admin routes (drafter swaps); None: no /admin routes (404)
    admin_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "default_max_tokens", "max_prefill_tokens", "max_waiting", "fast_rows_len",
                     "stream_interval"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len} must be >= 2")
        if not math.isfinite(self.admit_wait) or self.admit_wait < 0:
            raise ConfigError(f"admit_wait={self.admit_wait} must be a finite number >= 0 (prefill durations)")
        if self.admin_token is not None and not self.admin_token.strip():
            raise ConfigError("admin_token is empty: give a secret, or none to turn the /admin routes off")
        if self.shutdown_timeout < 0:
            raise ConfigError(f"shutdown_timeout={self.shutdown_timeout} must be >= 0")
