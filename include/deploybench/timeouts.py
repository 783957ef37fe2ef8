"""How long each task of a run may take, from the run's own durations.

Airflow kills a task that passes its ``execution_timeout``; a fixed number would be wrong for
both a 30 s lab run and a 2-hour soak. The budget of a task is what its configuration asks for
(load durations, probe steps, ready timeouts, iperf3 lengths) plus a margin for the fixed costs
(SSH, process starts, k6 start-up). A task that overruns it is stuck, not slow.
"""

from __future__ import annotations

import math

from deploybench.config import LinkMode, LoadPhase, RunConfig

MARGIN_S = 300.0  # SSH sessions, process starts, a slow node: the same on every run
# a k6-operator TestRun's fixed costs past its start: apply, the runners' logs read back, its deletion waited for
# (deploybench.load.kube_load)
TESTRUN_OVERHEAD_S = 60.0
FIXED_S = {"validate": 120.0, "store": 900.0, "report": 900.0, "finish": 120.0, "lease": 120.0}


def k6_operator_s(cfg: RunConfig, phase: str) -> float:
    """What a load phase's k6 runs add when a k6-operator TestRun sends each (kubernetes backend, parallelism > 0):
    per TestRun the operator's start (``start_timeout_s``: pods scheduled, image pulled) and its fixed costs
    (TESTRUN_OVERHEAD_S). The probe runs one TestRun per step; the other phases one."""
    from deploybench.config import RolloutBackend

    op = cfg.rollout.kubernetes.k6_operator
    if cfg.rollout.backend != RolloutBackend.KUBERNETES or not op.parallelism:
        return 0.0
    runs = cfg.load.probe_max_steps if phase == LoadPhase.PROBE.value else 1
    return runs * (op.start_timeout_s + TESTRUN_OVERHEAD_S)


def stage_budget_s(cfg: RunConfig, task: str, nodes: int) -> float:
    """Seconds the task named ``task`` (a stage, or a load phase) may run for a run of ``nodes`` nodes."""
    if task in FIXED_S:
        return FIXED_S[task]
    p, r, ld = cfg.preflight, cfg.rollout, cfg.load
    if task == "preflight":
        rounds = 3 if p.link_mode is LinkMode.RING else max(nodes, 2)
        per_test = ((p.iperf_seconds + p.omit_s) * (1 if p.bidir else 2) + 15  # + server start, retries on "busy"
                    + p.ping_count * max(p.ping_interval_s, 0.2))  # a user's ping may not go faster than 0.2 s
        rdma = 0 if p.rdma.value == "off" else p.rdma_seconds + 2 * 30  # ib_write_bw, ib_write_lat and their servers
        return rounds * (per_test + rdma) + MARGIN_S
    if task == "fanout":
        return cfg.fanout.timeout_s + MARGIN_S
    if task == "rollout":
        steps = max(1, math.ceil(math.log2(max(nodes, 1))) + 1) if not r.scale_steps else len(r.scale_steps) + 1
        from deploybench.engines import ready_timeout_s

        per_step = ready_timeout_s(cfg) + r.gate_warmup_s + r.gate_duration_s + ld.request_timeout_s + 60
        return steps * per_step + MARGIN_S
    if task == "teardown":
        return r.stop_grace_s + MARGIN_S
    from deploybench.config import SPIKE_LEAD_S
    from deploybench.engines import ready_timeout_s

    phase_s = {
        LoadPhase.PROBE.value: ld.probe_max_steps * (ld.probe_warmup_s + ld.probe_step_s + ld.request_timeout_s + 15),
        LoadPhase.SUSTAINED.value: ld.warmup_s + ld.duration_s + ld.request_timeout_s + 60,
        # + the engines started under load (scale_up) becoming ready
        LoadPhase.SPIKE.value: ld.warmup_s + SPIKE_LEAD_S + ld.spike_hold_s + ld.spike_recovery_s + ld.request_timeout_s
        + 60 + (ready_timeout_s(cfg) if ld.scale_up else 0),
        LoadPhase.OVERLOAD.value: ld.warmup_s + ld.overload_ramp_s + ld.recovery_s + ld.request_timeout_s + 60,
    }
    if task in phase_s:
        return phase_s[task] + k6_operator_s(cfg, task) + MARGIN_S
    known = sorted([*FIXED_S, *phase_s, "preflight", "fanout", "rollout", "teardown"])
    raise ValueError(f"no time budget for task {task!r}; known: {known}")
