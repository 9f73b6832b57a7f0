"""`eagle3 serve`: an OpenAI-compatible server with continuous batching and adaptive speculative decoding.

Modules: `protocol` (request validation, response shapes), `tools` (tool calls), `app` (FastAPI routes, SSE),
`scheduler` (the decode loop thread), `paths` (the rows path over the two rows backends,
`eagle3.fast.rows` and `eagle3.decoding.hf_rows`), `policy` (adaptive speculation, the speed gate), `output` (text and events),
`requests`, `metrics` (Prometheus text), `config` (`ServeConfig`), `server` (in-process runner), `loadgen`
(benchmark clients), `cli` (the `serve` subcommand). FastAPI and uvicorn are imported only by `app`, `server`
and `cmd_serve`.
"""
