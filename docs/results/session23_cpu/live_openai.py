#!/usr/bin/env python
"""End-to-end TTFT of a live `eagle3 serve` (a subprocess) with the `openai` client, stream=True, one client.

Per request: t_role = time to the first SSE chunk (the role chunk, sent once the app has parsed the request, applied
the chat template, tokenized and submitted: HTTP-side work only), ttft = time to the first chunk with content
(what bench_serving calls TTFT). Also reads the server's own arrival -> first token histogram from /metrics.

  PYTHONPATH=$PWD/src python /tmp/ttft/live_openai.py --out /tmp/ttft/live_cpu.json -- \
      --target smollm2 --drafter src/eagle3/assets/smollm2-drafter --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def main() -> int:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    from eagle3.evaluate import load_prompts

    _, prompts = load_prompts("mt_bench")
    port = free_port()
    cmd = [sys.executable, "-m", "eagle3.cli", "serve", "--port", str(port), "--served-model-name", "m",
           "--log-level", "warning", *serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open("/tmp/ttft/serve_stderr.log", "w"),
                            env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except Exception:
                if proc.poll() is not None or time.time() - t0 > 300:
                    raise RuntimeError("server did not start; see /tmp/ttft/serve_stderr.log") from None
                time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        rows = []
        before = urllib.request.urlopen(url + "/metrics").read().decode()
        for i in range(args.warmup + args.requests):
            if i == args.warmup:
                before = urllib.request.urlopen(url + "/metrics").read().decode()
            msgs = prompts[i % len(prompts)][:1]
            t_start = time.perf_counter()
            t_role = ttft = None
            if args.chat:
                stream = client.chat.completions.create(model="m", messages=msgs, max_tokens=args.max_tokens,
                                                        temperature=0, stream=True)
            else:
                stream = client.completions.create(model="m", prompt=msgs[0]["content"], max_tokens=args.max_tokens,
                                                   temperature=0, stream=True)
            n = 0
            for ch in stream:
                now = time.perf_counter()
                if t_role is None:
                    t_role = now - t_start
                piece = (ch.choices[0].delta.content if args.chat else ch.choices[0].text) if ch.choices else None
                if piece and ttft is None:
                    ttft = now - t_start
                n += 1
            total = time.perf_counter() - t_start
            if i >= args.warmup:
                rows.append({"t_role_ms": t_role * 1e3, "ttft_ms": ttft * 1e3 if ttft else None,
                             "latency_ms": total * 1e3, "chunks": n})
        after = urllib.request.urlopen(url + "/metrics").read().decode()
        name = "eagle3_time_to_first_token_seconds"
        srv_s = metric(after, name + "_sum") - metric(before, name + "_sum")
        srv_n = metric(after, name + "_count") - metric(before, name + "_count")
        med = lambda k: round(statistics.median(r[k] for r in rows if r[k] is not None), 3)  # noqa: E731
        summary = {"cmd": " ".join(cmd), "requests": len(rows), "t_role_ms_median": med("t_role_ms"),
                   "ttft_ms_median": med("ttft_ms"), "ttft_ms_min": round(min(r["ttft_ms"] for r in rows), 3),
                   "ttft_ms_max": round(max(r["ttft_ms"] for r in rows), 3), "latency_ms_median": med("latency_ms"),
                   "server_arrival_to_first_token_ms_mean": round(1e3 * srv_s / srv_n, 3) if srv_n else None}
        print(json.dumps(summary, indent=1))
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "requests": rows}, f, indent=1)
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
