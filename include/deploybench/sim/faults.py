"""The simulated engine's fault knobs, and the one place a lab run puts one on a node.

An operator puts a fault on a node in the inventory (``Node.sim_fault``, e.g. ``"throttle"``), never the trigger
form: what may run where is the operator's (the trust model of the design). The sim engine profile's
``{sim_args}`` then ends with that fault's flags on that node only (``deploybench.engines``); a profile of a real
engine refuses an inventory that names one. Each fault stands for a line of the runbook's troubleshooting table,
and a finding (deploybench.analyse.findings) must name it; its closed form is in ``service_model``:

- ``throttle``: the SM clock at ``THROTTLE_FRACTION`` of nominal, every step 1 / that longer
  (``ServiceParams.clock_fraction``), DCGM's clock-throttle reasons set to ``THROTTLE_REASON``;
- ``leak``: resident memory grows by ``LEAK_BYTES_PER_REQUEST`` per request answered (``leaked_bytes``);
- ``small_kv``: a KV cache of ``SMALL_KV_TOKENS`` tokens, too small for the batch: sequences are preempted
  (``kv_limited_capacity``) and the cache's usage sits near 1;
- ``no_batching``: one request per step, as a server with a batch of 1 (``ServiceParams.no_batching``);
- ``errors``: ``ERROR_RATE`` of the node's requests answered 500 (the engine's ``error_rate`` knob).
"""

from __future__ import annotations

from typing import Literal, get_args

SimFault = Literal["throttle", "leak", "small_kv", "no_batching", "errors"]
FAULTS: tuple[str, ...] = get_args(SimFault)

THROTTLE_FRACTION = 0.5  # a GPU in thermal slowdown runs well under its clocks: half is what HW slowdown does
# DCGM's clock-throttle reason bits (NVIDIA/DCGM dcgmlib/dcgm_fields.h: DCGM_CLOCKS_THROTTLE_REASON_*, the
# deprecated names of DCGM_CLOCKS_EVENT_REASON_*; the same as NVML's nvmlClocksThrottleReasons)
THROTTLE_REASON_GPU_IDLE = 0x1
THROTTLE_REASON_CLOCKS_SETTING = 0x2
THROTTLE_REASON_SW_POWER_CAP = 0x4
THROTTLE_REASON_HW_SLOWDOWN = 0x8
THROTTLE_REASON_SYNC_BOOST = 0x10
THROTTLE_REASON_SW_THERMAL = 0x20
THROTTLE_REASON_HW_THERMAL = 0x40
THROTTLE_REASON_HW_POWER_BRAKE = 0x80
THROTTLE_REASON = THROTTLE_REASON_SW_THERMAL  # what the throttle fault reports: a thermal slowdown
LEAK_BYTES_PER_REQUEST = 2 << 20  # 2 MiB a request: a short lab phase of tens of requests grows by tens of MiB
SMALL_KV_TOKENS = 80  # 5 blocks of 16: two short sequences fill it as they grow
ERROR_RATE = 0.2


def fault_args(fault: str | None) -> list[str]:
    """The sim engine's flags for ``fault`` (None: none); they come last, so they win over the run's knobs."""
    if fault is None:
        return []
    args = {
        "throttle": ["--throttle", f"{THROTTLE_FRACTION:g}"],
        "leak": ["--leak-bytes-per-request", str(LEAK_BYTES_PER_REQUEST)],
        "small_kv": ["--kv-cache-tokens", str(SMALL_KV_TOKENS)],
        "no_batching": ["--no-batching"],
        "errors": ["--error-rate", f"{ERROR_RATE:g}"],
    }
    return list(args[fault])
