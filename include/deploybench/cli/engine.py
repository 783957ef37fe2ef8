"""``deploybench engine serve|capacity|check`` and the flags of ``python -m deploybench.sim.engine``.

The flags' defaults are deploybench.config's EngineSpec and SimKnobs, so a sim started with
no flags serves the same model the run configuration describes by default.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from deploybench.config import EngineSpec, LoadSpec, ModelSpec, RolloutSpec, SimKnobs
from deploybench.sim.service_model import ServiceParams, capacity


def _add_knobs(parser: argparse.ArgumentParser) -> None:
    """The service-model knobs, shared by ``serve`` and ``capacity``."""
    eng, sim = EngineSpec(), SimKnobs()
    g = parser.add_argument_group("service model (times in ms)")
    g.add_argument("--max-num-seqs", type=int, default=eng.max_num_seqs, help="batch slots B (default %(default)s)")
    g.add_argument("--decode-base-ms", type=float, default=sim.decode_base_ms, help="fixed time of one iteration")
    g.add_argument("--decode-per-seq-ms", type=float, default=sim.decode_per_seq_ms,
                   help="extra iteration time per running sequence")
    g.add_argument("--prefill-per-token-ms", type=float, default=sim.prefill_per_token_ms,
                   help="prefill time per prompt token, paid in the iteration that admits the request")
    g.add_argument("--queue-limit", type=int, default=sim.queue_limit,
                   help="requests that may wait beyond the batch slots; more are refused with 429")
    g.add_argument("--slowdown", type=float, default=sim.slowdown, help="multiplier on every time")
    g.add_argument("--throttle", type=float, default=1.0, metavar="FRACTION",
                   help="fault: the SM clock at this fraction of nominal, every step 1/FRACTION longer, DCGM's "
                        "throttle reasons set (default 1: not throttled)")
    g.add_argument("--no-batching", action="store_true", help="fault: one request per step (a batch of 1)")
    g.add_argument("--drift-per-request", type=float, default=0.0, metavar="FRACTION",
                   help="fault: every answered request makes each later step this fraction longer (compounding), "
                        "so the throughput falls over a phase (default 0: no drift)")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    eng, sim = EngineSpec(), SimKnobs()
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=RolloutSpec().port, help="default %(default)s; 0 = any free port")
    parser.add_argument("--model-dir", required=True, help="model directory, verified against its manifest first")
    parser.add_argument("--served-model-name", default=ModelSpec().name, help="the model name the API answers to")
    parser.add_argument("--max-model-len", type=int, default=eng.max_model_len,
                        help="prompt + output tokens; the output is capped to fit")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="accepted for vLLM compatibility; ignored")
    _add_knobs(parser)
    c = parser.add_argument_group("prefix cache")
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=sim.prefix_caching,
                   help="reuse the KV blocks of a prompt prefix computed before, as vLLM v1 does by default")
    c.add_argument("--kv-cache-tokens", type=int, default=sim.kv_cache_tokens,
                   help="tokens the KV cache holds (whole 16-token blocks); 0 = what is left of 90%% of the GPU's "
                        "memory after the model")
    f = parser.add_argument_group("determinism and faults")
    f.add_argument("--seed", type=int, default=sim.seed, help="seed of the generated text and of injected errors")
    f.add_argument("--error-rate", type=float, default=sim.error_rate, help="fraction of requests answered 500")
    f.add_argument("--crash-after", type=int, default=sim.crash_after,
                   help="exit (code 3) after answering this many inference requests; 0 = never")
    f.add_argument("--no-dcgm", action="store_true",
                   help="leave DCGM's gauges off /metrics: a node without DCGM, whose GPU nvidia-smi reads (the lab's "
                        "nvidia-smi stand-in asks the engine's /sim/gpu)")
    f.add_argument("--leak-bytes-per-request", type=int, default=0,
                   help="fault: the resident memory it reports grows by this per answered request (default 0)")
    parser.add_argument("--loop", choices=["auto", "asyncio"], default="auto",
                        help="auto = uvloop when installed (default), asyncio = the standard loop")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def parse_serve_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m deploybench.sim.engine",
        description="The simulated LLM inference engine (vLLM's OpenAI API over a continuous-batching model).",
    )
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def params_from_args(args: argparse.Namespace) -> ServiceParams:
    return ServiceParams(
        max_num_seqs=args.max_num_seqs,
        decode_base_ms=args.decode_base_ms,
        decode_per_seq_ms=args.decode_per_seq_ms,
        prefill_per_token_ms=args.prefill_per_token_ms,
        queue_limit=args.queue_limit,
        slowdown=args.slowdown,
        clock_fraction=args.throttle,
        no_batching=args.no_batching,
        drift_per_request=args.drift_per_request,
    )


def options_from_args(args: argparse.Namespace):
    """EngineOptions from parsed flags; the knobs are validated by SimKnobs/EngineSpec (ConfigError)."""
    from pydantic import ValidationError

    from deploybench.config import format_validation_error
    from deploybench.errors import ConfigError
    from deploybench.sim.engine import EngineOptions

    try:
        spec = EngineSpec(
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            sim=SimKnobs(
                decode_base_ms=args.decode_base_ms, decode_per_seq_ms=args.decode_per_seq_ms,
                prefill_per_token_ms=args.prefill_per_token_ms, queue_limit=args.queue_limit, seed=args.seed,
                slowdown=args.slowdown, error_rate=args.error_rate, crash_after=args.crash_after,
                prefix_caching=args.enable_prefix_caching, kv_cache_tokens=args.kv_cache_tokens,
            ),
        )
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from exc
    if not 0 <= args.leak_bytes_per_request <= 1 << 40:
        raise ConfigError(f"--leak-bytes-per-request {args.leak_bytes_per_request}: must be 0 (no leak) to 2**40")
    # the faults (deploybench.sim.faults) are flags of the engine, not run knobs: an inventory puts them on a node
    params = replace(ServiceParams.from_config(spec), clock_fraction=args.throttle, no_batching=args.no_batching,
                     drift_per_request=args.drift_per_request)
    return EngineOptions(
        model_dir=args.model_dir,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        params=params,
        leak_bytes_per_request=args.leak_bytes_per_request,
        dcgm=not args.no_dcgm,
        max_model_len=spec.max_model_len,
        seed=spec.sim.seed,
        error_rate=spec.sim.error_rate,
        crash_after=spec.sim.crash_after,
        prefix_caching=spec.sim.prefix_caching,
        kv_cache_tokens=spec.sim.kv_cache_tokens,
    )


def _serve(args: argparse.Namespace) -> int:
    from deploybench.sim.engine import run

    return run(options_from_args(args), use_uvloop=args.loop != "asyncio")


def _capacity(args: argparse.Namespace) -> int:
    cap = capacity(params_from_args(args), args.prompt_tokens, args.output_tokens, args.cached_tokens)
    if args.json:
        print(json.dumps({**cap.as_dict(), "engines": args.engines,
                          "cluster_requests_per_s": args.engines * cap.requests_per_s}, indent=1))
        return 0
    n = args.engines
    rows = [
        ("workload", f"B={cap.max_num_seqs}, prompt {cap.prompt_tokens:g} tokens"
                     + (f" ({cap.cached_tokens:g} cached)" if cap.cached_tokens else "")
                     + f", output {cap.output_tokens:g} tokens"),
        ("saturation throughput",
         f"{cap.requests_per_s:.3f} requests/s, {cap.output_tokens_per_s:.1f} output tokens/s"),
        ("light load (alone)", f"TTFT {cap.single_ttft_ms:.1f} ms, ITL {cap.single_itl_ms:.1f} ms, "
                               f"E2E {cap.single_e2e_ms:.1f} ms"),
        ("full batch (in service)", f"TTFT {cap.full_ttft_min_ms:.1f}-{cap.full_ttft_max_ms:.1f} ms, "
                                    f"ITL {cap.full_iteration_ms:.1f} ms (mean), E2E {cap.full_e2e_ms:.1f} ms"),
        ("full queue adds", f"{cap.full_queue_wait_ms:.1f} ms of waiting"),
    ]
    if n > 1:
        rows.append((f"{n} engines", f"{n * cap.requests_per_s:.3f} requests/s, "
                                     f"{n * cap.output_tokens_per_s:.1f} output tokens/s"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from deploybench import engines
    from deploybench.load import conformance

    prof = engines.load_profile_file(args.profile) if args.profile.endswith(".toml") else engines.profile(args.profile)
    rows = conformance.check(prof, args.url, args.model, args.timeout, args.metrics_port)
    print(f"engine check: profile {prof.name} ({prof.source}), {args.url}, model {args.model!r}")
    print(conformance.table(rows))
    bad = conformance.mismatches(rows)
    print(f"{len(bad)} mismatch{'es' if len(bad) != 1 else ''}"
          + (": " + ", ".join(r.check for r in bad) if bad else ""))
    return 1 if bad else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    engine = subparsers.add_parser("engine", help="the simulated inference engine")
    sub = engine.add_subparsers(dest="engine_command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI API over a continuous-batching model")
    add_serve_arguments(serve)
    serve.set_defaults(func=_serve)
    cap = sub.add_parser("capacity", help="closed-form throughput and latencies of one engine")
    cap.add_argument("--prompt-tokens", type=float, default=LoadSpec().prompt_tokens,
                     help="mean prompt tokens (default %(default)s)")
    cap.add_argument("--output-tokens", type=float, default=LoadSpec().output_tokens,
                     help="mean output tokens (default %(default)s)")
    cap.add_argument("--cached-tokens", type=float, default=0.0,
                     help="mean prompt tokens found in the prefix cache, not prefilled (default %(default)s)")
    cap.add_argument("--engines", type=int, default=1, help="also print the figures for this many engines")
    cap.add_argument("--json", action="store_true", help="print JSON")
    _add_knobs(cap)
    cap.set_defaults(func=_capacity)
    check = sub.add_parser("check", help="check an engine you started against its profile: readiness, completions, "
                                         "streaming, token counts, every metric the profile names")
    check.add_argument("--profile", required=True, help="a profile's name, or a profile file (.toml)")
    check.add_argument("--url", required=True, help="the engine's base URL, e.g. http://gpu-box:8000")
    check.add_argument("--model", default=ModelSpec().name, help="the served model name (default %(default)s)")
    check.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default %(default)s)")
    check.add_argument("--metrics-port", type=int, default=None,
                       help="the engine's metrics port when it is not the profile's (Triton's --metrics-port)")
    check.set_defaults(func=_check)
