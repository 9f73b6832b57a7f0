"""`eagle3 serve`: an OpenAI-compatible server with continuous batching and adaptive speculative decoding.

Modules: `protocol` (request validation, response shapes), `tools` (tool calls), `app` (FastAPI routes, SSE),
`scheduler` (the decode loop thread), `paths` (the fast lane and the rows path), `hf_rows` (rows of any HF model),
`batch` (their padded KV cache, batched prefill and verification; the rows' drafters are
`eagle3.decoding.drafters`), `policy` (adaptive speculation, the speed gate), `output` (text and events),
`requests`, `metrics` (Prometheus text), `config` (`ServeConfig`), `server` (in-process runner), `loadgen`
(benchmark clients), `cli` (the `serve` subcommand). FastAPI and uvicorn are imported only by `app`, `server`
and `cmd_serve`.
"""
