"""The simulated engine in Triton's shape: what ``tritonserver`` with its vLLM backend answers, for the lab.

The lab's nodes have no Triton, so the lab puts a ``tritonserver`` of its own on their PATH (after the system's:
a real one wins); it runs ``main`` here (through ``deploybench.sim.stand_in``, which gives the process the command
line a real one has). Like the real server it takes
``--model-repository``, ``--http-address``, ``--http-port``, ``--metrics-port`` (default 8002),
``--allow-metrics`` and ``--allow-grpc``, refuses any other option, and reads the repository as Triton and its
vLLM backend would (triton-inference-server/vllm_backend src/model.py and src/utils/request.py):

- exactly one model folder, ``<model>/config.pbtxt`` parsed with Triton's own ModelConfig protobuf, checked as the
  vLLM backend checks it (``deploybench.engines.check_triton_backend``: max_batch_size 0; KIND_MODEL with tensor
  parallel), and ``<model>/1/model.json`` naming the weights' folder (vLLM's engine arguments: ``model``,
  ``max_num_seqs``, ``max_model_len``, ``tensor_parallel_size``); a repository the backend would refuse never
  becomes ready: the process exits non-zero naming what is wrong;
- ``parameters { key: "REPORT_CUSTOM_METRICS" ... "true" }`` in config.pbtxt adds the vLLM backend's own metrics
  (src/utils/metrics.py: ``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds``,
  ``vllm:e2e_request_latency_seconds``, ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``) to
  Triton's page; without it only Triton's ``nv_inference_*`` are there.

HTTP (KServe v2 and Triton's generate extension): GET ``/v2/health/ready``, ``/v2/health/live``,
``/v2/models/<m>/ready``, ``/v2/models/<m>``; POST ``/v2/models/<m>/generate`` (one JSON answer) and
``generate_stream`` (one SSE event per token, no ``[DONE]``: Triton ends the stream by closing it). The body's
top-level keys are the model's inputs (``text_input``; ``stream``; ``exclude_input_in_output``: without it a
non-streamed answer starts with the prompt, and a stream refuses it set to false; ``return_num_input_tokens``,
``return_num_output_tokens``: the counts, per response), ``parameters`` the sampling parameters (vLLM's
SamplingParams fields: an unknown one such as ``stream`` fails the request, as the backend's
``TritonSamplingParams.from_dict`` does). Metrics are on the metrics port only, labelled ``model``/``version``:
``nv_inference_request_success``/``_failure``, ``nv_inference_count`` and ``nv_inference_exec_count`` (equal:
max_batch_size 0 is a model Triton does not batch; the vLLM engine behind it does, see docs/user_guide/metrics.md
of triton-inference-server/server), the cumulative ``nv_inference_request_duration_us``,
``nv_inference_queue_duration_us`` (here: the time a request waited for a batch slot) and
``nv_inference_compute_infer_duration_us`` (from its admission to its last token), and the
``nv_inference_pending_request_count`` gauge (requests waiting).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from deploybench.sim.server import LAST_CHUNK, HttpError, Request, chunk, response, stream_head
from deploybench.sim.service_model import TokenStream, chain_hashes, tokenize

if TYPE_CHECKING:
    from deploybench.sim.engine import EngineServer
    from deploybench.sim.metrics import EngineMetrics

log = logging.getLogger("deploybench.sim.engine")

DEFAULT_METRICS_PORT = 8002  # tritonserver --metrics-port (docs/user_guide/metrics.md)
DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default
# SamplingParams fields the backend passes on (vllm/sampling_params.py), and Triton's own lora_name
SAMPLING_FIELDS = frozenset({
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "lora_name", "structured_outputs",
})
_DUMPS = json.JSONEncoder(separators=(",", ":")).encode


class TritonApi:
    """Answers Triton's HTTP for one ``EngineServer`` whose ``opts.protocol`` is "triton"."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.name = server.opts.served_model_name
        self.seed = server.opts.seed
        self.max_model_len = server.opts.max_model_len

    def route(self, req: Request) -> tuple[str, str] | None:
        """(method, what) for a Triton path; None: not one of Triton's."""
        path = req.path
        if path in ("/v2/health/ready", "/v2/health/live"):
            return "GET", "health"
        if not path.startswith("/v2/models/"):
            return None
        model, _, tail = path[len("/v2/models/"):].partition("/")
        model = unquote(model)
        if tail.startswith("versions/1/"):
            tail = tail[len("versions/1/"):]
        if model != self.name:
            return "ANY", "unknown-model"
        return {"": ("GET", "metadata"), "ready": ("GET", "health"), "generate": ("POST", "generate"),
                "generate_stream": ("POST", "generate_stream")}.get(tail, ("ANY", "not-found"))

    def metadata(self) -> bytes:
        return _DUMPS({"name": self.name, "versions": ["1"], "platform": "vllm", "inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [1]}], "outputs": [
            {"name": "text_output", "datatype": "BYTES", "shape": [-1]}]}).encode()

    async def handle(self, what: str, req: Request, writer: asyncio.StreamWriter) -> bool:
        """Answer one generate request; False when the connection must close."""
        server, keep = self.server, req.keep_alive
        m = server.metrics
        try:
            text, tokens, out, stream, prepend, counts = self._parse(what, req.json())
        except HttpError as exc:
            m.failure += 1
            writer.write(response(exc.status, _DUMPS({"error": str(exc)}).encode(), keep_alive=keep))
            await writer.drain()
            return True
        if server.inject_error():
            m.errors += 1
            m.failure += 1
            writer.write(response(500, b'{"error":"injected error (error_rate knob of the simulated engine)"}',
                                  keep_alive=keep))
            await writer.drain()
            server.count_answer()
            return True
        prompt_tokens = len(tokens)
        # hashed only when the cache is on: the CPU is shared by many engines and the load generator
        job = server.engine.submit(prompt_tokens, out, chain_hashes(tokens) if server.prefix_caching else ())
        if job is None:
            m.refused += 1
            m.failure += 1
            writer.write(response(429, b'{"error":"the engine is full; retry later or lower the rate"}',
                                  keep_alive=keep))
            await writer.drain()
            return True
        answer = TokenStream(text, self.seed)
        try:
            if stream:
                await self._stream(job, out, answer, prompt_tokens, counts, writer, keep)
            else:
                await server.engine.wait(job, out)
                body: dict[str, Any] = {"model_name": self.name, "model_version": "1",
                                        "text_output": (text if prepend else "") + "".join(
                                            answer.token(i) for i in range(out))}
                if counts[0]:
                    body["num_input_tokens"] = prompt_tokens
                if counts[1]:
                    body["num_output_tokens"] = [out]
                writer.write(response(200, _DUMPS(body).encode(), keep_alive=keep))
                await writer.drain()
        except BaseException:
            server.engine.cancel(job)
            raise
        m.success += 1
        server.count_answer()
        return True

    def _parse(self, what: str, body: Any) -> tuple[str, list[str], int, bool, bool, tuple[bool, bool]]:
        """(prompt, its tokens, output tokens, stream, prepend the prompt, (return input count, output count))."""
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        text = body.get("text_input")
        if isinstance(text, list) and len(text) == 1:
            text = text[0]
        if not isinstance(text, str):
            raise HttpError(400, "expected 1 input 'text_input' of type BYTES (a string)")
        flags = {}
        for key in ("stream", "exclude_input_in_output", "return_num_input_tokens", "return_num_output_tokens"):
            v = body.get(key)
            if v is not None and not isinstance(v, bool):
                raise HttpError(400, f"input '{key}' must be a boolean (got {v!r})")
            flags[key] = v
        known = {"text_input", "parameters", "id", *flags} | {"image", "sampling_parameters", "return_finish_reason",
                                                              "return_cumulative_logprob", "return_logprobs"}
        extra = sorted(set(body) - known)
        if extra:  # Triton: an input the model does not declare
            raise HttpError(400, f"unexpected inference input {extra[0]!r} for model {self.name!r}")
        stream = bool(flags["stream"])
        if what == "generate_stream" and not stream:
            stream = True  # generate_stream answers as a stream; the backend reads the input (request.py)
        exclude = flags["exclude_input_in_output"]
        # vllm_backend src/utils/request.py: prepend unless excluded; a stream never prepends, and refuses False
        prepend = not exclude if exclude is not None else not stream
        if prepend and stream:
            raise HttpError(400, "When streaming, `exclude_input_in_output` = False is not allowed.")
        params = body.get("parameters") or {}
        if not isinstance(params, dict):
            raise HttpError(400, "parameters must be a JSON object")
        unknown = sorted(set(params) - SAMPLING_FIELDS)
        if unknown:
            raise HttpError(400, f"[vllm] Was trying to create `TritonSamplingParams`, but got exception: unexpected "
                                 f"keyword argument {unknown[0]!r} (a sampling parameter; `stream` is an input)")
        max_tokens = params.get("max_tokens", DEFAULT_MAX_TOKENS)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise HttpError(400, f"max_tokens must be an integer >= 1 (got {max_tokens!r})")
        tokens = tokenize(text)
        prompt_tokens = len(tokens)
        if prompt_tokens >= self.max_model_len:
            raise HttpError(400, f"the prompt's {prompt_tokens} tokens do not fit max_model_len={self.max_model_len}")
        out = min(max_tokens, self.max_model_len - prompt_tokens)
        counts = (bool(flags["return_num_input_tokens"]), bool(flags["return_num_output_tokens"]))
        return text, tokens, out, stream, prepend, counts

    async def _stream(self, job, total: int, tokens: TokenStream, prompt_tokens: int, counts: tuple[bool, bool],
                      writer, keep: bool) -> None:
        engine = self.server.engine
        head = '{"model_name":' + _DUMPS(self.name) + ',"model_version":"1"'
        writer.write(stream_head(keep))
        sent = 0
        while sent < total:
            got = await engine.wait(job, sent + 1)
            parts = []
            for i in range(sent, got):
                extra = (f',"num_input_tokens":{prompt_tokens}' if counts[0] else "") + (
                    ',"num_output_tokens":[1]' if counts[1] else "")
                parts.append(chunk(f'data: {head},"text_output":{_DUMPS(tokens.token(i))}{extra}}}\n\n'.encode()))
            sent = got
            writer.write(b"".join(parts))
            await writer.drain()
        writer.write(LAST_CHUNK)
        await writer.drain()


def render_metrics(m: EngineMetrics, model: str, custom: bool) -> str:
    """Triton's metrics page for the one model (the module doc); ``custom``: with the vLLM backend's own."""
    lb = f'model="{model}",version="1"'

    def one(name: str, kind: str, help_text: str, value: float) -> list[str]:
        return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{lb}}} {value}"]

    out = [
        *one("nv_inference_request_success", "counter", "Number of successful inference requests, all batch sizes",
             m.success),
        *one("nv_inference_request_failure", "counter", "Number of failed inference requests, all batch sizes",
             m.failure),
        *one("nv_inference_count", "counter", "Number of inferences performed (does not include cached requests)",
             m.success),
        *one("nv_inference_exec_count", "counter", "Number of model executions performed", m.success),
        *one("nv_inference_request_duration_us", "counter", "Cumulative inference request duration in microseconds",
             round(m.request_us)),
        *one("nv_inference_queue_duration_us", "counter", "Cumulative inference queuing duration in microseconds",
             round(m.queue_us)),
        *one("nv_inference_compute_infer_duration_us", "counter",
             "Cumulative compute inference duration in microseconds", round(m.compute_us)),
        *one("nv_inference_pending_request_count", "gauge", "Instantaneous number of pending requests awaiting "
             "execution per-model.", m.waiting),
        *m.gpu_lines(),
    ]
    if custom:  # vllm_backend src/utils/metrics.py, labelled as the backend labels them
        out += one("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", m.prompt_tokens)
        out += one("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
                   m.generation_tokens)
        out += m.ttft.render("vllm:time_to_first_token_seconds", lb, "Histogram of time to first token in seconds.")
        out += m.itl.render("vllm:time_per_output_token_seconds", lb, "Histogram of time per output token in seconds.")
        out += m.e2e.render("vllm:e2e_request_latency_seconds", lb,
                            "Histogram of end to end request latency in seconds.")
    return "\n".join(out) + "\n"


# -- the lab's tritonserver -------------------------------------------------------------------------------------
class RepositoryError(Exception):
    """A model repository Triton or its vLLM backend would not load."""


def read_repository(repo: str) -> tuple[str, dict, bool]:
    """(model name, model.json, REPORT_CUSTOM_METRICS) of the one model in ``repo``, checked as Triton and its vLLM
    backend check it; RepositoryError names what they would refuse."""
    from deploybench import engines
    from deploybench.errors import ConfigError

    root = Path(repo)
    models = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if len(models) != 1:
        raise RepositoryError(f"model repository {repo}: expected one model folder, found {len(models)}")
    folder = models[0]
    try:
        cfg = engines.parse_triton_config((folder / "config.pbtxt").read_text())
    except OSError as exc:
        raise RepositoryError(f"{folder}/config.pbtxt: {exc}") from exc
    except ConfigError as exc:
        raise RepositoryError(str(exc)) from exc
    if cfg.name and cfg.name != folder.name:
        raise RepositoryError(f"config.pbtxt names model {cfg.name!r} in folder {folder.name!r}: they must match")
    if cfg.backend != "vllm":
        raise RepositoryError(f"backend {cfg.backend!r}: the lab's tritonserver stands in for the vllm backend only")
    try:
        args = json.loads((folder / "1" / "model.json").read_text())
    except (OSError, ValueError) as exc:
        raise RepositoryError(f"{folder}/1/model.json: {exc}") from exc
    if not isinstance(args, dict) or not isinstance(args.get("model"), str):
        raise RepositoryError(f"{folder}/1/model.json must be an object naming the weights' folder in 'model'")
    try:
        engines.check_triton_backend(cfg, int(args.get("tensor_parallel_size") or 1))
    except ConfigError as exc:
        raise RepositoryError(str(exc)) from exc
    if not Path(args["model"]).is_dir():
        raise RepositoryError(f"model.json names {args['model']!r}, which is no folder on this node")
    param = cfg.parameters.get("REPORT_CUSTOM_METRICS")
    custom = param is not None and param.string_value.lower() == "true"  # vllm_backend _get_bool_config_param
    return folder.name, args, custom


def parse_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """tritonserver's options this stand-in knows (``--name=value`` or ``--name value``), and the simulated
    engine's own (``--sim-<option>``, passed on); SystemExit names any other."""
    known = {"model-repository", "http-address", "http-port", "metrics-port", "allow-metrics", "allow-grpc",
             "metrics-address", "log-verbose"}
    switches = {"enable-prefix-caching", "no-enable-prefix-caching"}  # the engine's options that take no value
    opts: dict[str, str] = {}
    sim: list[str] = []
    it = iter(argv)
    for arg in it:
        if not arg.startswith("--"):
            raise SystemExit(f"tritonserver (the lab's stand-in): unexpected argument {arg!r}")
        name, eq, value = arg[2:].partition("=")
        if name.startswith("sim-"):
            if name[4:] in switches:
                sim.append(f"--{name[4:]}")
            else:
                sim += [f"--{name[4:]}", value] if eq else [f"--{name[4:]}", next(it, "")]
            continue
        if name not in known:
            raise SystemExit(f"tritonserver (the lab's stand-in): unrecognized option '--{name}'")
        opts[name] = value if eq else next(it, "")
    if "model-repository" not in opts:
        raise SystemExit("tritonserver (the lab's stand-in): --model-repository is required")
    return opts, sim


def main(argv: list[str] | None = None) -> int:
    from deploybench.cli.engine import options_from_args, parse_serve_args
    from deploybench.sim import engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    opts, sim = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        name, args, custom = read_repository(opts["model-repository"])
    except RepositoryError as exc:
        log.error("failed to load the model repository: %s", exc)
        return 1
    serve = ["--model-dir", args["model"], "--served-model-name", name,
             "--host", opts.get("http-address") or "0.0.0.0", "--port", opts.get("http-port") or "8000",
             "--max-num-seqs", str(args.get("max_num_seqs") or 256), "--max-model-len",
             str(args.get("max_model_len") or 4096), *sim]
    eo = options_from_args(parse_serve_args(serve))
    from dataclasses import replace

    metrics_port = int(opts.get("metrics-port") or DEFAULT_METRICS_PORT)
    allowed = (opts.get("allow-metrics") or "true").lower() != "false"
    eo = replace(eo, protocol="triton", metrics_port=metrics_port if allowed else None, triton_custom_metrics=custom)
    log.info("model %r (vllm backend%s), weights %s", name, ", custom metrics" if custom else "", args["model"])
    return engine.run(eo)


if __name__ == "__main__":
    raise SystemExit(main())
