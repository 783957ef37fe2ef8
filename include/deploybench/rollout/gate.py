"""The checks a rollout step must pass: a smoke check per new engine, then a short gate load.

The smoke check asks the engine for its model list and one deterministic completion
(OpenAI flavour), or for the model's readiness and one generate call (Triton). The gate
runs the real k6 through ``deploybench.load.run_load`` at a modest rate against every
serving engine and judges it against the SLO's error rate and P99 latency; fewer measured
requests than ``gate_min_requests`` is a failure too, because no data is not a pass.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from deploybench import http
from deploybench.config import RunConfig
from deploybench.engines import EngineProfile
from deploybench.errors import DeploybenchError

log = logging.getLogger(__name__)

SMOKE_PROMPT = "deploybench smoke test: say something deterministic"
SMOKE_TOKENS = 8


class SmokeFailed(DeploybenchError):
    pass


def smoke(prof: EngineProfile, base_url: str, model: str, seed: int) -> str:
    """"ok" when the model is served and one deterministic request answers as it should; SmokeFailed otherwise."""
    try:
        if prof.api == "triton":
            # KServe v2 model readiness: the status says it (200), the body is empty
            if not http.is_up(f"{base_url}/v2/models/{model}/ready", timeout=5):
                raise SmokeFailed(f"model {model!r} is not ready (GET /v2/models/{model}/ready did not answer 200)")
            # the vLLM backend's inputs (triton-inference-server/vllm_backend src/utils/request.py): without
            # exclude_input_in_output a non-streamed answer starts with the prompt, so an empty answer would pass
            body = http.post_json(f"{base_url}/v2/models/{model}/generate", {
                "text_input": SMOKE_PROMPT, "stream": False, "exclude_input_in_output": True,
                "parameters": {"max_tokens": SMOKE_TOKENS, "temperature": 0}})
            if not body.get("text_output"):
                raise SmokeFailed(f"generate on model {model!r} came back without text_output: {body}")
            return "ok"
        listed = [m.get("id") for m in http.get_json(f"{base_url}/v1/models").get("data", [])]
        if model not in listed:
            raise SmokeFailed(f"model {model!r} is not served (listed: {listed})")
        body = http.post_json(f"{base_url}/v1/completions", {
            "model": model, "prompt": SMOKE_PROMPT, "max_tokens": SMOKE_TOKENS, "temperature": 0})
    except (http.HTTPFailure, ValueError) as exc:  # ValueError: an answer that is not JSON
        raise SmokeFailed(f"smoke request failed: {exc}") from exc
    text = body["choices"][0]["text"]
    if prof.deterministic:
        from deploybench.sim.service_model import expected_completion

        want = expected_completion(SMOKE_PROMPT, SMOKE_TOKENS, seed)
        if text != want:
            raise SmokeFailed(f"smoke completion {text!r} differs from the expected {want!r}")
    elif not text:
        raise SmokeFailed("smoke completion came back empty")
    return "ok"


def gate_load(endpoints: list[dict], cfg: RunConfig, prof: EngineProfile, out_dir: Path, step: int) -> dict[str, Any]:
    """One short k6 phase ("gate-<step>") over ``endpoints``; returns its figures and ``passed``/``reasons``."""
    from deploybench import load

    r = cfg.rollout
    eps = [load.Endpoint.of(e, prof.metrics.url(e["url"])) for e in endpoints]
    spec = cfg.load.model_copy(update={"warmup_s": r.gate_warmup_s})
    slo = cfg.slo.model_copy(update={"min_rps": 0.0})  # the cluster target is for the full scale, not a gate
    rate = r.gate_rate_per_node * len(eps)
    try:
        res = load.run_load(eps, spec, slo, out_dir, phase=f"gate-{step}", rate=rate, duration_s=r.gate_duration_s,
                            tags={"rollout_step": str(step)}, api="triton" if prof.api == "triton" else None,
                            metrics=prof.metrics, max_model_len=cfg.engine.max_model_len)
    except DeploybenchError as exc:
        return {"passed": False, "reasons": [f"the gate load could not run: {exc}"], "requests": 0, "errors": 0,
                "error_rate": None, "latency_p99_ms": None, "slo_ok": False, "rate": rate}
    reasons = [] if res.slo_ok else list(res.slo.reasons)
    if res.requests < r.gate_min_requests:
        reasons.append(f"only {res.requests} requests measured, fewer than gate_min_requests={r.gate_min_requests} "
                       "(no data is not a pass)")
    out = {"passed": not reasons, "reasons": reasons, "requests": res.requests, "errors": res.errors,
           "error_rate": res.error_rate, "latency_p99_ms": res.latency_p99_ms, "slo_ok": res.slo_ok, "rate": rate,
           "duration_s": r.gate_duration_s}
    log.info("gate %d: %d requests at %.1f req/s, errors %.2f%%, P99 %s ms -> %s", step, res.requests, rate,
             100 * res.error_rate, res.latency_p99_ms, "pass" if not reasons else "FAIL: " + "; ".join(reasons))
    return out
