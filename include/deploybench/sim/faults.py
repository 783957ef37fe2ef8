"""The simulated engine's fault knobs, and the one place a lab run puts one on a node.

An operator puts a fault on a node in the inventory (``Node.sim_fault``, e.g. ``"throttle"``), never the trigger
form: what may run where is the operator's (the trust model of the design). The sim engine profile's
``{sim_args}`` then ends with that fault's flags on that node only (``deploybench.engines.fault_args``, where the
magnitudes below live, in the base layer the inventory and the engines' commands share); a profile of a real
engine refuses an inventory that names one. Each fault stands for a line of the runbook's troubleshooting table,
and a finding (deploybench.analyse.findings) must name it; its closed form is in ``service_model``:

- ``throttle``: the SM clock at ``THROTTLE_FRACTION`` of nominal, every step 1 / that longer
  (``ServiceParams.clock_fraction``), DCGM's clock-throttle reasons set to ``THROTTLE_REASON``;
- ``leak``: resident memory grows by ``LEAK_BYTES_PER_REQUEST`` per request answered (``leaked_bytes``);
- ``small_kv``: a KV cache of ``SMALL_KV_TOKENS`` tokens, too small for the batch: sequences are preempted
  (``kv_limited_capacity``) and the cache's usage sits near 1;
- ``no_batching``: one request per step, as a server with a batch of 1 (``ServiceParams.no_batching``);
- ``errors``: ``ERROR_RATE`` of the node's requests answered 500 (the engine's ``error_rate`` knob);
- ``drift``: every answered request makes each later step ``DRIFT_PER_REQUEST`` longer, compounding
  (``ServiceParams.drift_per_request``, closed form ``drift_completion_ms``): the throughput falls over the phase.
"""

from __future__ import annotations

from deploybench.engines import (  # the flags live with the engines' commands (base layer), re-exported here
    DRIFT_PER_REQUEST,
    ERROR_RATE,
    LEAK_BYTES_PER_REQUEST,
    SMALL_KV_TOKENS,
    THROTTLE_FRACTION,
    fault_args,
)
from deploybench.inventory import FAULTS, SimFault

__all__ = ["DRIFT_PER_REQUEST", "ERROR_RATE", "FAULTS", "LEAK_BYTES_PER_REQUEST", "SMALL_KV_TOKENS",
           "THROTTLE_FRACTION", "SimFault", "THROTTLE_REASON", "fault_args"]

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
