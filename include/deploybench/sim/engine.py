"""The simulated LLM inference engine: vLLM's OpenAI HTTP surface over a continuous-batching model.

It stands in for a GPU running vLLM on a lab node. Its timing comes from
``deploybench.sim.service_model.BatchScheduler`` driven by a scheduler task that sleeps to
absolute deadlines of the event loop's clock, so its throughput matches the closed form of
``service_model.capacity`` whatever the CPU noise; its text comes from
``service_model.expected_completion``.

HTTP is served by plain asyncio with the small HTTP/1.1 layer below (keep-alive,
Content-Length and chunked request bodies, ``Expect: 100-continue``, chunked SSE responses)
and, when installed, the uvloop event loop, because 16 engines share two cores with k6: measured
side by side against a bare uvicorn+starlette app, it spent 2-3x less server CPU per request
(0.15-0.20 vs 0.39-0.47 ms for a whole answer, 1.1-1.7 vs 2.7-4.3 ms for a 64-token stream),
and it is ready in about 0.45 s including the sha256 check of a 64 MB model.
Prefix caching (``prefix_caching``, on by default as in vLLM v1): each request's prompt is hashed into
blocks (``service_model.chain_hashes``, only then) and looked up at admission in a
``service_model.PrefixCache`` of ``kv_cache_tokens`` (0: what is left of ``GPU_MEMORY_UTILIZATION`` x the
GPU's memory after the model, at ``KV_MIB_PER_TOKEN``); its cached tokens are not prefilled, and
``vllm:prefix_cache_queries_total``/``_hits_total`` count them; an answered request's prompt and answer blocks
are cached (OpenAI API; a conversation's next turn finds them). Measured side by side
(bench/sim_request_cpu.py), a request with a 2,000-token prompt costs 0.37 ms of CPU with it, 0.25 ms without.
Faults: ``error_rate`` answers that fraction of inference requests 500 at once (drawn from a
``random.Random(seed)``, so a seed repeats the pattern); ``crash_after`` N makes the process
exit with code 3 right after its N-th answered inference request (200 or injected 500); and the knobs of
``deploybench.sim.faults`` (a throttled clock, a leak, a KV cache too small, no batching), each with its closed form.

Endpoints: POST /v1/completions and /v1/chat/completions (``stream`` with SSE and
``stream_options.include_usage``), GET /v1/models, /health, /version, /metrics (vLLM's metric
names, labelled ``model_name``), and Triton's /v2/health/ready and /v2/health/live.
Refusals: 400 bad body, 404 unknown model or path, 405 wrong method, 413 body too large,
429 when ``max_num_seqs + queue_limit`` requests are already in the engine (the engine is
healthy but full; 503 is kept for "not ready"), 500 for injected errors (``error_rate``).
Start: ``python -m deploybench.sim.engine --model-dir DIR ...`` (flags in ``deploybench.cli.engine``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from deploybench.errors import DeploybenchError
from deploybench.sim.api import OpenAIApi
from deploybench.sim.metrics import GPU_MEMORY_MIB, GPU_MEMORY_UTILIZATION, KV_MIB_PER_TOKEN, EngineMetrics
from deploybench.sim.nvidia_smi import GPU_DIR_ENV
from deploybench.sim.server import HttpError, Request, error_body, read_request, response
from deploybench.sim.service_model import (
    BLOCK_TOKENS,
    BatchScheduler,
    PrefixCache,
    Sequence,
    ServiceParams,
    chain_hashes,
)
from deploybench.sim.triton import TritonApi, render_metrics

log = logging.getLogger("deploybench.sim.engine")

CRASH_EXIT_CODE = 3  # the process exits with this after ``crash_after`` requests
MANIFEST_EXIT_CODE = 2  # the model directory does not match its manifest
BIND_EXIT_CODE = 4  # the address could not be bound


class EngineError(DeploybenchError):
    """The simulated engine cannot start (bad model directory, address in use)."""


@dataclass(frozen=True)
class EngineOptions:
    """Everything one engine process is started with (see ``deploybench.cli.engine.add_serve_arguments``)."""

    model_dir: str
    params: ServiceParams
    served_model_name: str = "sim-model"
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int = 4096
    seed: int = 0
    error_rate: float = 0.0
    crash_after: int = 0
    protocol: str = "openai"  # or "triton": Triton's HTTP and metrics (deploybench.sim.triton)
    metrics_port: int | None = None  # Triton's metrics on a port of their own
    triton_custom_metrics: bool = False  # the vLLM backend's REPORT_CUSTOM_METRICS
    prefix_caching: bool = True  # vLLM v1's automatic prefix caching
    kv_cache_tokens: int = 0  # the KV cache's size; 0 = from the GPU's memory (kv_cache_blocks)
    leak_bytes_per_request: int = 0  # the leak fault (deploybench.sim.faults)
    dcgm: bool = True  # DCGM's gauges on /metrics; False: a node without DCGM, its GPU read by nvidia-smi


class _Job:
    """A request's state between the HTTP handler and the scheduler (``Sequence.handle``)."""

    __slots__ = ("seq", "arrival", "admitted", "last", "want", "waiter")

    def __init__(self, seq: Sequence, arrival: float) -> None:
        self.seq = seq
        self.arrival = arrival
        self.admitted = arrival
        self.last = 0.0
        self.want = seq.output_tokens  # wake the handler once this many tokens are out
        self.waiter: asyncio.Future | None = None


class Engine:
    """The scheduler task: runs iterations of ``BatchScheduler`` against absolute deadlines."""

    def __init__(self, params: ServiceParams, metrics: EngineMetrics, cache: PrefixCache | None = None,
                 kv_blocks: int | None = None) -> None:
        self.sched = BatchScheduler(params, cache=cache, kv_blocks=kv_blocks)
        self.metrics = metrics
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-scheduler")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def cache_answer(self, prompt: list[str], answer: list[str]) -> None:
        """Cache the full blocks of a finished request's prompt and answer, as vLLM caches a block of generated
        tokens once it is full (vllm/v1/core/kv_cache_manager.py, cache_blocks): a conversation's next turn, sent
        with this answer, finds them."""
        if self.sched.cache is not None:
            self.sched.cache.insert(chain_hashes(prompt + answer))

    def submit(self, prompt_tokens: int, output_tokens: int, blocks: tuple[int, ...] = ()) -> _Job | None:
        """Queue a request (``blocks``: its prompt's ``block_hashes``, for the prefix cache); None when full."""
        seq = Sequence(prompt_tokens, output_tokens, blocks=blocks)
        job = _Job(seq, time.monotonic())
        seq.handle = job
        if not self.sched.submit(seq):
            return None
        self._wake.set()
        return job

    async def wait(self, job: _Job, tokens: int) -> int:
        """Wait until ``tokens`` tokens of ``job`` are out (or all of them); return how many are."""
        job.want = tokens
        if job.seq.generated < tokens:
            job.waiter = asyncio.get_running_loop().create_future()
            await job.waiter
        return job.seq.generated

    def cancel(self, job: _Job) -> None:
        self.sched.cancel(job.seq)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched, m = self.sched, self.metrics
        start = loop.time()
        while True:
            if not sched.busy:
                self._wake.clear()
                await self._wake.wait()
                start = loop.time()
            it = sched.start_iteration()
            if it is None:
                continue
            m.batch(sched.running, len(sched.waiting))
            began = time.monotonic()
            caching = sched.cache is not None
            m.preemptions = sched.preemptions
            for seq in it.admitted:
                if seq.preempted:  # admitted again after a preemption: counted and queued once already
                    continue
                m.prompt_tokens += seq.prompt_tokens
                if caching:
                    m.prefix_queries += seq.prompt_tokens
                    m.prefix_hits += seq.cached_tokens
                job = cast(_Job, seq.handle)
                job.admitted = began
                m.queue_us += 1e6 * max(0.0, began - job.arrival)
                m.queue.observe(max(0.0, began - job.arrival))
            deadline = start + it.duration_ms / 1000.0
            fut = loop.create_future()
            handle = loop.call_at(deadline, _resolve, fut)
            try:
                await fut
            finally:
                handle.cancel()
            start = deadline  # the next iteration starts at this deadline, not when we woke: no drift
            done = sched.finish_iteration(it)
            now = time.monotonic()
            m.generation_tokens += len(it.running)
            for seq in it.running:
                job = cast(_Job, seq.handle)
                if seq.generated == 1:
                    m.ttft.observe(now - job.arrival)
                else:
                    m.itl.observe(now - job.last)
                job.last = now
                if seq.generated >= job.want and job.waiter is not None:
                    waiter, job.waiter = job.waiter, None
                    if not waiter.done():
                        waiter.set_result(None)
            for seq in done:
                job = cast(_Job, seq.handle)
                m.e2e.observe(now - job.arrival)
                m.compute_us += 1e6 * (now - job.admitted)
                m.request_us += 1e6 * (now - job.arrival)
            m.batch(sched.running, len(sched.waiting))


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class EngineServer:
    """The HTTP front of one engine: parses requests, asks ``Engine`` for tokens, writes answers."""

    def __init__(self, opts: EngineOptions) -> None:
        self.opts = opts
        size = model_bytes(opts.model_dir)
        self.kv_blocks = kv_cache_blocks(opts.kv_cache_tokens, size)
        self.metrics = EngineMetrics(opts.served_model_name, opts.params.max_num_seqs, size, self.kv_blocks,
                                     clock_fraction=opts.params.clock_fraction,
                                     leak_bytes_per_request=opts.leak_bytes_per_request, dcgm=opts.dcgm)
        self.prefix_caching = opts.prefix_caching
        cache = PrefixCache(self.kv_blocks) if opts.prefix_caching else None
        # one pool, as vLLM's: the blocks that cache prefixes are the blocks the running sequences hold
        self.engine = Engine(opts.params, self.metrics, cache, kv_blocks=self.kv_blocks or None)
        self._rng = random.Random(opts.seed)
        self._answered = 0
        self._ids = 0
        self._created = int(time.time())
        self._server: asyncio.Server | None = None
        self._metrics_server: asyncio.Server | None = None
        self._gpu_entry: Path | None = None  # where this engine's GPU is listed for nvidia-smi (register_gpu)
        self.api = OpenAIApi(self)
        self.triton = TritonApi(self) if opts.protocol == "triton" else None

    async def start(self) -> None:
        self.engine.start()
        try:
            self._server = await asyncio.start_server(
                self._connection, self.opts.host, self.opts.port, limit=1 << 16, backlog=1024, reuse_address=True
            )
        except OSError as exc:
            raise EngineError(f"cannot listen on {self.opts.host}:{self.opts.port}: {exc.strerror or exc}") from exc
        if self.opts.metrics_port is not None:
            try:
                self._metrics_server = await asyncio.start_server(
                    self._metrics_connection, self.opts.host, self.opts.metrics_port, reuse_address=True)
            except OSError as exc:
                raise EngineError(f"cannot listen on {self.opts.host}:{self.opts.metrics_port} (metrics): "
                                  f"{exc.strerror or exc}") from exc

    @property
    def port(self) -> int:
        """The bound port (useful with ``port=0``)."""
        return self._server.sockets[0].getsockname()[1] if self._server else self.opts.port

    def register_gpu(self) -> Path | None:
        """List this engine's simulated GPU where the lab's nvidia-smi stand-in looks (``$GPU_DIR_ENV``, a folder
        of the node's own: deploybench.sim.nvidia_smi): a file naming its ``/sim/gpu`` URL, written whole then
        renamed, removed at close. None (nothing listed) without that folder: nvidia-smi then finds no GPU."""
        folder = os.environ.get(GPU_DIR_ENV)
        if not folder or not Path(folder).is_dir():
            return None
        host = self.opts.host if self.opts.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        entry = Path(folder) / f"gpu-{self.port}.json"
        tmp = entry.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"url": f"http://{host}:{self.port}/sim/gpu", "pid": os.getpid()}))
            tmp.replace(entry)
        except OSError as exc:  # the engine serves all the same; nvidia-smi will not find its GPU
            log.warning("cannot list the simulated GPU in %s for nvidia-smi: %s", folder, exc)
            return None
        self._gpu_entry = entry
        return entry

    async def close(self) -> None:
        if self._gpu_entry is not None:
            self._gpu_entry.unlink(missing_ok=True)
        if self._server:
            self._server.close()
        if self._metrics_server:
            self._metrics_server.close()
        await self.engine.stop()

    def next_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{os.getpid():x}{self._ids:010x}"

    def inject_error(self) -> bool:
        return self.opts.error_rate > 0 and self._rng.random() < self.opts.error_rate

    def count_answer(self) -> None:
        """Count an answered inference request; the ``crash_after``-th one takes the process down."""
        self._answered += 1
        self.metrics.answered = self._answered
        if self.opts.crash_after and self._answered >= self.opts.crash_after:
            log.error("crash_after=%d requests reached: the engine exits (code %d)", self.opts.crash_after,
                      CRASH_EXIT_CODE)
            logging.shutdown()
            os._exit(CRASH_EXIT_CODE)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    req = await read_request(reader, writer)
                except HttpError as exc:
                    writer.write(response(exc.status, error_body(exc.status, str(exc)), keep_alive=False))
                    await writer.drain()
                    break
                if req is None:
                    break
                if not await self._dispatch(req, writer) or not req.keep_alive:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    def metrics_page(self) -> bytes:
        if self.triton is not None:
            return render_metrics(self.metrics, self.opts.served_model_name, self.opts.triton_custom_metrics).encode()
        return self.metrics.render().encode()

    async def _metrics_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The metrics port: GET /metrics, nothing else."""
        try:
            while (req := await read_request(reader, writer)) is not None:
                if req.path != "/metrics" or req.method != "GET":
                    writer.write(response(404, b"", keep_alive=req.keep_alive))
                else:
                    writer.write(response(200, self.metrics_page(), content_type="text/plain; version=0.0.4",
                                          keep_alive=req.keep_alive))
                await writer.drain()
                if not req.keep_alive:
                    break
        except (HttpError, ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _dispatch(self, req: Request, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection must close."""
        if req.path == "/sim/gpu" and req.method == "GET":  # the simulated GPU's driver, for nvidia-smi's stand-in
            writer.write(response(200, json.dumps(self.metrics.smi_values()).encode(), keep_alive=req.keep_alive))
            await writer.drain()
            return True
        if self.triton is not None:
            return await self._dispatch_triton(self.triton, req, writer)
        route = _ROUTES.get(req.path)
        if route is None:
            writer.write(response(404, b'{"detail":"Not Found"}', keep_alive=req.keep_alive))
            return True
        method, name = route
        if req.method != method:
            writer.write(response(405, b'{"detail":"Method Not Allowed"}', keep_alive=req.keep_alive))
            return True
        if name in ("completions", "chat"):
            return await self.api.handle(name, req, writer)
        if name == "health":
            writer.write(response(200, b"", keep_alive=req.keep_alive))
        elif name == "models":
            writer.write(response(200, self.api.models_body(), keep_alive=req.keep_alive))
        elif name == "version":
            writer.write(response(200, b'{"version":"deploybench-sim"}', keep_alive=req.keep_alive))
        elif name == "metrics":
            writer.write(response(200, self.metrics_page(), content_type="text/plain; version=0.0.4",
                                  keep_alive=req.keep_alive))
        await writer.drain()
        return True

    async def _dispatch_triton(self, api: TritonApi, req: Request, writer: asyncio.StreamWriter) -> bool:
        """Triton's HTTP (deploybench.sim.triton): its metrics are on the metrics port, not here."""
        keep = req.keep_alive
        route = api.route(req)
        if route is None or route[1] in ("unknown-model", "not-found"):
            what = "unknown model" if route and route[1] == "unknown-model" else "Not Found"
            writer.write(response(404, json.dumps({"error": what}).encode(), keep_alive=keep))
        elif route[0] != req.method:
            writer.write(response(405, b'{"error":"Method Not Allowed"}', keep_alive=keep))
        elif route[1] in ("generate", "generate_stream"):
            return await api.handle(route[1], req, writer)
        elif route[1] == "health":
            writer.write(response(200, b"", keep_alive=keep))
        else:
            writer.write(response(200, api.metadata(), keep_alive=keep))
        await writer.drain()
        return True


_ROUTES = {
    "/v1/completions": ("POST", "completions"),
    "/v1/chat/completions": ("POST", "chat"),
    "/v1/models": ("GET", "models"),
    "/health": ("GET", "health"),
    "/v2/health/ready": ("GET", "health"),
    "/v2/health/live": ("GET", "health"),
    "/version": ("GET", "version"),
    "/metrics": ("GET", "metrics"),
}


def kv_cache_blocks(kv_cache_tokens: int, model_bytes: int) -> int:
    """The KV cache's size in blocks: ``kv_cache_tokens`` when set, else what vLLM would take: the GPU's memory
    x ``GPU_MEMORY_UTILIZATION`` less the model, at ``KV_MIB_PER_TOKEN`` (none when the model fills it)."""
    if kv_cache_tokens:
        return kv_cache_tokens // BLOCK_TOKENS
    free_mib = GPU_MEMORY_MIB * GPU_MEMORY_UTILIZATION - model_bytes / 2**20
    return max(0, int(free_mib / KV_MIB_PER_TOKEN)) // BLOCK_TOKENS


def model_bytes(model_dir: str) -> int:
    """The model's size as its manifest records it (0 when there is none): the sim's GPU memory baseline."""
    from deploybench.manifest import Manifest

    try:
        return Manifest.read(model_dir).total_bytes
    except (OSError, ValueError, KeyError, TypeError, DeploybenchError):
        return 0


def verify_model_dir(model_dir: str) -> None:
    """Check every file of ``model_dir`` against its manifest; EngineError names the bad file."""
    from deploybench.manifest import ManifestMismatch, verify

    t0 = time.monotonic()
    if not Path(model_dir).is_dir():
        raise EngineError(f"model directory {model_dir} does not exist; "
                          "pass --model-dir a directory seeded with a manifest")
    try:
        manifest = verify(model_dir)
    except ManifestMismatch as exc:
        raise EngineError(f"model directory {model_dir} does not match its manifest: {exc}") from exc
    log.info(
        "model %s verified: %d files, %.1f MB, digest %s (%.2f s)",
        model_dir, len(manifest.files), manifest.total_bytes / 1e6, manifest.digest[:16], time.monotonic() - t0,
    )


async def serve(opts: EngineOptions, ready: asyncio.Event | None = None) -> None:
    """Run one engine until SIGTERM/SIGINT (or cancellation)."""
    server = EngineServer(opts)
    await server.start()
    server.register_gpu()
    p = opts.params
    log.info(
        "engine %r ready on http://%s:%d (max_num_seqs=%d queue_limit=%d decode=%.3g+%.3g*n ms prefill=%.3g ms/token "
        "slowdown=%.3g error_rate=%.3g crash_after=%d seed=%d prefix_caching=%s kv_cache=%d blocks "
        "throttle=%.3g no_batching=%s leak=%d bytes/request)",
        opts.served_model_name, opts.host, server.port, p.max_num_seqs, p.queue_limit, p.decode_base_ms,
        p.decode_per_seq_ms, p.prefill_per_token_ms, p.slowdown, opts.error_rate, opts.crash_after, opts.seed,
        "on" if opts.prefix_caching else "off", server.kv_blocks, p.clock_fraction, p.no_batching,
        opts.leak_bytes_per_request,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
        log.info("engine %r stopping", opts.served_model_name)
    finally:
        await server.close()


def run(opts: EngineOptions, use_uvloop: bool = True) -> int:
    """Verify the model directory, then serve; the process's exit code."""
    try:
        verify_model_dir(opts.model_dir)
    except EngineError as exc:
        log.error("%s", exc)
        return MANIFEST_EXIT_CODE
    runner = asyncio.run
    if use_uvloop:
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            log.debug("uvloop not installed: the standard asyncio loop serves")
    try:
        runner(serve(opts))
    except EngineError as exc:
        log.error("%s", exc)
        return BIND_EXIT_CODE
    return 0


def main(argv: list[str] | None = None) -> int:
    from deploybench.cli.engine import parse_serve_args

    args = parse_serve_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    from deploybench.cli.engine import options_from_args

    try:
        opts = options_from_args(args)
    except DeploybenchError as exc:  # a knob out of range (ConfigError names it)
        log.error("%s", exc)
        return 2
    return run(opts, use_uvloop=args.loop != "asyncio")


if __name__ == "__main__":
    raise SystemExit(main())
