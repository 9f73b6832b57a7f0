"""`eagle3 serve`: an OpenAI-compatible server with continuous batching and adaptive speculative decoding.

Modules: `protocol` (request validation, response shapes), `app` (FastAPI routes, SSE), `scheduler`
(the decode loop thread), `batch` (padded batch KV cache, batched prefill/verify), `drafting` (batched
EAGLE-3 drafter, per-row proposers), `policy` (adaptive speculation), `sampling` (position-keyed
sampling), `metrics` (Prometheus text), `config` (`ServeConfig`), `server` (in-process runner),
`cli` (the `serve` subcommand). FastAPI and uvicorn are imported only by `app`, `server` and `cmd_serve`.
"""
