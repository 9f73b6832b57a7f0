"""Run a fixed-shape step function eagerly, or replay it as a manually captured CUDA graph.

Manual capture (`torch.cuda.CUDAGraph` with a shared memory pool) rather than `torch.compile(mode=
"reduce-overhead")`: the step functions read and write preallocated buffers only, so the graph needs no static
input copies and its behaviour does not depend on cudagraph-tree heuristics. Optionally the function is first
compiled with inductor (`torch.compile(fullgraph=True, dynamic=False)`, no cudagraphs of its own), which fuses
the elementwise work, and the compiled kernels are then captured. If compilation fails, the runner logs it and
captures the eager function instead; if capture itself fails, the runner logs it and runs eagerly.

Warm-up runs the function for real, so callers capture before loading a request and reset their state after.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import torch
from torch._dynamo import exc as _dynamo_exc

log = logging.getLogger("eagle3.fast")

# One process compiles the same step functions for many shapes (tree and chain sizes, plain and
# speculative engines, the overhead benchmark's 13 shapes): more than dynamo's default of 8 recompiles per function.
RECOMPILE_LIMIT = 64


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every capture on `device` uses. torch.cuda.graph's default capture stream is made once, on
    whichever GPU is current at that moment, so a model on another GPU would run its kernels outside the capture
    and get a graph that replays nothing; one stream per GPU (not one per capture) keeps the shared memory pool
    reusing blocks across captures as the default stream did."""
    if device.index is None:  # "cuda": the current GPU
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


class StepRunner:
    """`runner()` runs `fn`; on CUDA with `graphs`, `prepare()` captures it and later calls replay the graph."""

    def __init__(self, fn: Callable[[], None], device: torch.device, graphs: bool = True, pool=None,
                 name: str = "step", warmup: int = 2, reset: Callable[[], None] | None = None):
        """`reset`: run after each warm-up call (on its stream), to undo what a step that runs for real did."""
        self.call, self.name, self.warmup, self.reset = fn, name, warmup, reset
        self.device = torch.device(device)
        self.use_graphs = graphs and self.device.type == "cuda"
        self.pool = pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.prepare_s = 0.0

    def _warm(self) -> None:
        for _ in range(self.warmup):
            self.call()
            if self.reset is not None:
                self.reset()

    def prepare(self) -> None:
        """Warm up and capture; a no-op for eager runners."""
        if self.graph is not None or not self.use_graphs:
            return
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._warm()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(self.device)
        # A CUDA graph freed while another is being captured (by the cyclic garbage collector: engines and
        # their runners reference each other) invalidates that capture, and every later capture into the
        # pool then fails. torch no longer collects before a capture, so collect here and not during it.
        gc.collect()
        gc_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=capture_stream(self.device)):
                self.call()
            torch.cuda.synchronize(self.device)
            self.graph = graph
        except RuntimeError as e:  # keep decoding (eagerly) and say so; --no-graphs avoids the attempt
            torch.cuda.set_stream(stream)  # a capture that failed to begin leaves its side stream current
            log.warning("CUDA graph capture of %s failed (%s); running it eagerly", self.name,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            self.use_graphs = False
        finally:
            if gc_enabled:
                gc.enable()
        self.prepare_s = time.perf_counter() - t0
        log.info("prepared %s in %.2fs (graph=%s)", self.name, self.prepare_s, self.graph is not None)

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.call()


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT) -> None:
    """Let dynamo keep at least `limit` compilations per function before it silently falls back to eager."""
    from torch import _dynamo

    _dynamo.config.recompile_limit = max(_dynamo.config.recompile_limit, limit)


class CompiledPieces:
    """Methods of `owner` that may run inductor-compiled (`compile(names)`); `run(name, *args)` calls the compiled
    one if there is one, else the method as it was when compiled. A compiled piece compiles on its first call and
    again for new shapes or new plain-value arguments (a sampling mode): if dynamo or inductor fails there, the
    failure is logged and that variant (the piece with those plain values) runs eagerly from then on, while the
    variants that compiled keep running compiled (errors of the computation itself propagate). `label` names a
    single piece in that warning (default "the <what> <name>")."""

    def __init__(self, owner: object, what: str = "cycle piece", label: str | None = None):
        self.owner, self.what, self.label = owner, what, label
        self.fns: dict[str, Callable] = {}
        self.eager: dict[str, Callable] = {}  # the methods as compiled (the owner may rebind the names to `run`)
        self.tried: set[str] = set()  # pieces that have run compiled
        self.failed: set[tuple] = set()  # (name, plain-value arguments) whose compilation failed: eager

    def compile(self, names: list[str], backend: str | Callable = "inductor", dynamic: bool = False,
                fullgraph: bool = True, mode: str | None = None) -> None:
        """`mode`: torch.compile's mode for the inductor backend (e.g. "max-autotune-no-cudagraphs": Triton
        templates for the matrix products where they time faster, with their elementwise epilogues fused)."""
        raise_recompile_limit()
        self.eager = {n: getattr(self.owner, n) for n in names}
        self.fns = {n: torch.compile(f, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode)
                    for n, f in self.eager.items()}
        self.tried, self.failed = set(), set()

    def __bool__(self) -> bool:
        """Whether a piece runs compiled: one has, or one has not failed yet."""
        failed = {v[0] for v in self.failed}
        return any(n in self.tried or n not in failed for n in self.fns)

    def _eager(self, name: str) -> Callable:
        return self.eager[name] if name in self.eager else getattr(self.owner, name)

    def run(self, name: str, *args, **kwargs):
        fn = self.fns.get(name)
        variant = (name, *(a for a in args if isinstance(a, (bool, int, str))))  # what dynamo specialises on
        if fn is None or variant in self.failed:
            return self._eager(name)(*args, **kwargs)
        try:
            out = fn(*args, **kwargs)
        except _dynamo_exc.TorchDynamoException as e:  # a tracing or code generation failure (on the first call,
            # or on a recompilation) happens before the piece runs: run this variant eagerly from now on
            log.warning("torch.compile of %s failed%s (%s: %s); running it eagerly",
                        self.label or f"the {self.what} {name}", f" for arguments {variant[1:]}" if variant[1:] else "",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.failed.add(variant)
            return self._eager(name)(*args, **kwargs)
        self.tried.add(name)
        return out


def graph_pool(device: torch.device):
    """One memory pool shared by the graphs of an engine (they never run concurrently)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.graph_pool_handle()
    return None
