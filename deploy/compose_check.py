"""`make compose-check`: build deploybench's image and start docker-compose.yaml for real, then run a benchmark.

On a private Docker daemon (its own data-root, exec-root, pidfile and socket; --iptables=false
--ip-forward=false --ip-masq=false --bridge=none, so the host's netfilter rules, its FORWARD policy and
the labs' namespaces are left alone), in order, each step timed:

 1. start dockerd;
 2. the stand-in base images, made locally because no container registry is reachable here:
    bookworm by debootstrap + `docker import`, then deploy/standin/airflow.Dockerfile (Airflow 3.3.2
    installed the way the official image has it) and deploy/standin/postgres.Dockerfile;
 3. `docker-compose config` (the file, with this run's .env, validated);
 4. `docker-compose build` (./Dockerfile on the stand-in base);
 5. `up -d`, then wait until postgres, api-server, scheduler, dag-processor and triggerer are healthy
    and airflow-init exited 0;
 6. log in through the REST API (POST /auth/token, the simple auth manager's admin);
 7. a 2-node lab in loopback mode inside the scheduler container (LocalExecutor: the task processes,
    the simulated engines and k6 all run there), named in DEPLOYBENCH_INVENTORIES;
 8. wait until deploybench_run is parsed, unpause it, trigger a small fast run and wait for success;
 9. the results pages on the api-server answer with that run (/deploybench/api/runs, the run's page,
    its HTML report);
10. `down -v`;
11. with ``--celery``, steps 3-10 again with the CeleryExecutor profile (``--profile celery``: the redis broker,
    a stand-in built here like the others, and two Celery workers, each with its own deploybench home): the lab
    in worker 1's container (worker 2 shares its network and processes), the run's tasks spread over the two
    workers' queues (DEPLOYBENCH_TASK_QUEUES), and besides success: at least two distinct worker host names among
    the run's task instances (the REST API's ``hostname``), and the results pages answering with the run's
    report, which the api-server never had on its disk (pulled from the results database);
12. stop dockerd, unmount and delete what it made.

Steps 10-12 run whatever failed before (try/finally), and every step has a time limit. The daemon's
data-root is a cache kept between local runs (base images and build layers: a warm run) in
$DEPLOYBENCH_COMPOSE_CACHE (default /var/cache/deploybench-compose-check); `--fresh` (the default when
$CI is set) uses a new one and deletes it afterwards: a cold run. Root, docker.io, docker-compose and
debootstrap are needed (`--install`, which `make compose-check` passes, installs them; `.ci/bootstrap` does not).
`make compose-check` passes `--celery` too: both passes, one stack after the other on the same daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parents[1]
DEBIAN_IMAGE = "local/debian:bookworm"
AIRFLOW_STANDIN = "deploybench-standin/airflow:3.3.2-python3.11"
POSTGRES_STANDIN = "deploybench-standin/postgres:15"
REDIS_STANDIN = "deploybench-standin/redis:7"
PROJECT_IMAGE = "deploybench-airflow:compose-check"
PROJECT = "lcdeploybench"
LAB = "lc"
DAG_ID = "deploybench_run"
PACKAGES = ("docker.io", "docker-compose", "debootstrap")
DOCKER = "/usr/bin/docker"
DOCKERD = "/usr/sbin/dockerd"
COMPOSE = "/usr/bin/docker-compose"
DEBOOTSTRAP = "/usr/sbin/debootstrap"
ADDRESS_POOL = "172.30.0.0/16"  # compose networks; the labs use 10.100-227.x and 127.x
SERVICES = ("postgres", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer")
CELERY_SERVICES = ("redis", "airflow-worker-1", "airflow-worker-2")  # the `celery` profile
CELERY_QUEUES = "worker-1,worker-2"  # each worker's own queue (docker-compose.yaml); a run's tasks take them in turn
RUN_CONF = {"inventory": LAB, "nodes": 2, "canary_nodes": 1, "iperf_seconds": 1, "link_threshold": 0.5,
            "load_rate": 4, "load_duration_s": 4, "warmup_s": 1, "output_tokens": 16, "prompt_tokens": 64}

LIMITS_S = {"dockerd": 30, "debian": 300, "standin": 900, "config": 60, "build": 900, "up": 300, "healthy": 420,
            "login": 60, "lab": 120, "dag": 300, "run": 600, "pages": 60, "down": 120}
_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class CheckFailed(Exception):
    """A step did not do what it should; the message says which and what was seen."""


def log(msg: str) -> None:
    print(f"[compose-check] {msg}", flush=True)


class Steps:
    """Each step's wall time, printed as it ends and as a table at the end."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float, str]] = []
        self.t0 = time.monotonic()

    @contextmanager
    def __call__(self, name: str):
        log(f"{name} ...")
        t = time.monotonic()
        status = "failed"
        try:
            yield
            status = "ok"
        finally:
            took = time.monotonic() - t
            self.times.append((name, took, status))
            log(f"{name}: {status} in {took:.1f} s")

    def table(self) -> str:
        lines = [f"  {name:<44} {took:7.1f} s  {status}" for name, took, status in self.times]
        lines.append(f"  {'total':<44} {time.monotonic() - self.t0:7.1f} s")
        return "\n".join(lines)


def run(argv: list[str], timeout: float, env: dict | None = None, check: bool = True, quiet: bool = False,
        **kw) -> subprocess.CompletedProcess:
    """Run a command with a time limit; its output goes to ours unless ``quiet`` (then it is captured)."""
    if quiet:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
    try:
        done = subprocess.run(argv, timeout=timeout, env=env, stdin=subprocess.DEVNULL, **kw)
    except subprocess.TimeoutExpired as exc:
        raise CheckFailed(f"{argv[0]} {' '.join(argv[1:4])} ...: not done within {timeout:.0f} s") from exc
    if check and done.returncode:
        out = ((done.stdout or "") + (done.stderr or ""))[-3000:] if quiet else ""
        raise CheckFailed(f"{' '.join(argv[:6])} ... exited {done.returncode}\n{out}")
    return done


# -- the private Docker daemon -------------------------------------------------------------------
class Dockerd:
    """dockerd with everything private: started by ``start``, gone (with its mounts) after ``stop``."""

    def __init__(self, data_root: Path, exec_root: Path, log_file: Path):
        self.data_root, self.exec_root, self.log_file = data_root, exec_root, log_file
        self.sock = exec_root / "docker.sock"
        self.pidfile = exec_root / "dockerd.pid"
        self.proc: subprocess.Popen | None = None
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.sock}", "DOCKER_BUILDKIT": "0",
                    "COMPOSE_DOCKER_CLI_BUILD": "0", "COMPOSE_HTTP_TIMEOUT": "300"}

    def start(self, timeout_s: float) -> None:
        self.data_root.mkdir(parents=True, exist_ok=True)
        self.exec_root.mkdir(parents=True, exist_ok=True)
        config = self.exec_root / "daemon.json"
        config.write_text("{}\n")
        argv = [DOCKERD, f"--config-file={config}", f"--data-root={self.data_root}", f"--exec-root={self.exec_root}",
                f"--pidfile={self.pidfile}", f"--host=unix://{self.sock}", "--iptables=false", "--ip-forward=false",
                "--ip-masq=false", "--bridge=none", f"--default-address-pool=base={ADDRESS_POOL},size=24",
                "--log-level=warn"]
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise CheckFailed(f"dockerd exited {self.proc.returncode}:\n{self.log_tail()}")
            if run([DOCKER, "info", "--format", "{{.ServerVersion}}"], 10, env=self.env, check=False,
                   quiet=True).returncode == 0:
                return
            time.sleep(0.5)
        raise CheckFailed(f"dockerd did not answer on {self.sock} within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_file.read_text(errors="replace")[-chars:] if self.log_file.exists() else ""

    def stop(self) -> list[str]:
        """SIGTERM (SIGKILL after 30 s) to dockerd and its process group, then unmount whatever is still
        mounted under the exec-root and data-root; returns the mounts that could not be removed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self.proc is not None:
            try:  # containerd and shims dockerd started in its session
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        left = []
        for mnt in reversed(mounts_under((self.exec_root, self.data_root))):
            if subprocess.run(["umount", "-l", mnt], capture_output=True).returncode:
                left.append(mnt)
        return left


def mounts_under(roots: tuple[Path, ...]) -> list[str]:
    prefixes = tuple(str(r.resolve()) + "/" for r in roots) + tuple(str(r.resolve()) for r in roots)
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mnt = line.split()[4].replace("\\040", " ")
        if mnt.startswith(prefixes):
            found.append(mnt)
    return found


# -- images ---------------------------------------------------------------------------------------
def has_image(d: Dockerd, ref: str) -> bool:
    return run([DOCKER, "image", "inspect", ref], 30, env=d.env, check=False, quiet=True).returncode == 0


def debian_mirror() -> str:
    """The Debian mirror the host's apt uses (the only one reachable)."""
    for f in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            text = f.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split()
            if words[:1] == ["URIs:"] and len(words) > 1 and "security" not in words[1]:
                return words[1]
            if words[:1] == ["deb"] and "security" not in line:
                return next(w for w in words[1:] if "://" in w)
    return "http://deb.debian.org/debian"


def make_debian(d: Dockerd, work: Path) -> None:
    rootfs = work / "rootfs"
    run([DEBOOTSTRAP, "--variant=minbase", "bookworm", str(rootfs), debian_mirror()], LIMITS_S["debian"],
        quiet=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    try:
        subprocess.run([DOCKER, "import", "-", DEBIAN_IMAGE], stdin=tar.stdout, env=d.env, check=True,
                       timeout=120, capture_output=True)
    finally:
        if tar.stdout is not None:
            tar.stdout.close()
        tar.wait(timeout=60)
    shutil.rmtree(rootfs, ignore_errors=True)


def standins(celery: bool) -> tuple[tuple[str, str], ...]:
    both = ((AIRFLOW_STANDIN, "airflow.Dockerfile"), (POSTGRES_STANDIN, "postgres.Dockerfile"))
    return (*both, (REDIS_STANDIN, "redis.Dockerfile")) if celery else both


def build_standins(d: Dockerd, work: Path, celery: bool = False) -> None:
    ctx = work / "standin-context"
    shutil.copytree(ROOT / "deploy" / "standin", ctx, dirs_exist_ok=True)
    shutil.copy(Path("/etc/ssl/certs/ca-certificates.crt"), ctx / "ca-certificates.crt")
    for ref, dockerfile in standins(celery):
        if not has_image(d, ref):
            run([DOCKER, "build", "--network", "host", "-q", "-t", ref, "-f", str(ctx / dockerfile),
                 "--build-arg", f"BASE={DEBIAN_IMAGE}", str(ctx)], LIMITS_S["standin"], env=d.env, quiet=True)


# -- the stack ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """docker-compose on ROOT/docker-compose.yaml with this run's env file, project name and daemon."""

    def __init__(self, d: Dockerd, work: Path, celery: bool = False):
        self.d, self.celery = d, celery
        self.services = (*SERVICES, *CELERY_SERVICES) if celery else SERVICES
        self.lab_service = "airflow-worker-1" if celery else "airflow-scheduler"  # where tasks run
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.password = secrets.token_urlsafe(16)
        inventories, secrets_dir = work / "inventories", work / "secrets"
        inventories.mkdir(exist_ok=True)
        secrets_dir.mkdir(exist_ok=True)
        self.env_file = work / "compose.env"
        results_password = secrets.token_urlsafe(16)
        values = {
            "AIRFLOW_UID": "50000",
            "_AIRFLOW_WWW_USER_USERNAME": "admin",
            "_AIRFLOW_WWW_USER_PASSWORD": self.password,
            "POSTGRES_PASSWORD": secrets.token_urlsafe(16),
            "DEPLOYBENCH_RESULTS_PASSWORD": results_password,
            "AIRFLOW_JWT_SECRET": secrets.token_urlsafe(32),
            "REDIS_PASSWORD": secrets.token_urlsafe(24),  # the celery profile's broker (required by the file)
            "AIRFLOW_API_PUBLISH": f"127.0.0.1:{self.port}",
            "AIRFLOW_IMAGE": AIRFLOW_STANDIN,
            "POSTGRES_IMAGE": POSTGRES_STANDIN,
            "DEPLOYBENCH_IMAGE": PROJECT_IMAGE,
            "DEPLOYBENCH_INVENTORIES_DIR": str(inventories),
            "DEPLOYBENCH_SECRETS_DIR": str(secrets_dir),
            # the check's loopback lab writes its inventory into the state volume
            "DEPLOYBENCH_INVENTORIES": "/opt/deploybench/inventories:/var/lib/deploybench/lab",
            "AIRFLOW_PARALLELISM": "4",
            "AIRFLOW_DAG_REFRESH_S": "30",
            **({"AIRFLOW_EXECUTOR": "CeleryExecutor", "REDIS_IMAGE": REDIS_STANDIN,
                "DEPLOYBENCH_TASK_QUEUES": CELERY_QUEUES} if celery else {}),
        }
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
        self.env_file.chmod(0o600)
        self._token: str | None = None

    def compose(self, *args: str, timeout: float, quiet: bool = False, check: bool = True):
        return run([COMPOSE, "--project-name", PROJECT, "--project-directory", str(ROOT), "--file",
                    str(ROOT / "docker-compose.yaml"), "--env-file", str(self.env_file),
                    *(["--profile", "celery"] if self.celery else []), *args], timeout,
                   env=self.d.env, quiet=quiet, check=check, cwd=ROOT)

    def container(self, service: str) -> str | None:
        out = self.compose("ps", "-q", service, timeout=60, quiet=True).stdout.strip()
        return out or None

    def health(self) -> dict[str, str]:
        """Each service's health (or state when it has no health check), and airflow-init's exit."""
        states = {}
        for svc in (*self.services, "airflow-init"):
            cid = self.container(svc)
            if not cid:
                states[svc] = "absent"
                continue
            got = json.loads(run([DOCKER, "inspect", cid], 30, env=self.d.env, quiet=True).stdout)[0]["State"]
            if svc == "airflow-init":
                states[svc] = "exited 0" if got["Status"] == "exited" and got["ExitCode"] == 0 else \
                    (f"exited {got['ExitCode']}" if got["Status"] == "exited" else got["Status"])
            else:
                states[svc] = got.get("Health", {}).get("Status", got["Status"])
        return states

    def logs(self, tail: int = 60) -> str:
        done = self.compose("logs", "--no-color", f"--tail={tail}", timeout=60, quiet=True, check=False)
        return (done.stdout or "") + (done.stderr or "")

    # REST
    def request(self, method: str, path: str, body: dict | None = None, token: bool = True,
                raw: bool = False):
        headers = {"Accept": "application/json", "Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {self.token()}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with _LOOPBACK.open(req, timeout=30) as resp:
            payload = resp.read()
            return (resp.status, payload.decode(errors="replace")) if raw else json.loads(payload or b"null")

    def token(self) -> str:
        if self._token is None:
            got = self.request("POST", "/auth/token", {"username": "admin", "password": self.password}, token=False)
            self._token = got["access_token"]
        return self._token


def wait_for(what: str, probe, timeout_s: float, every_s: float = 2.0, on_timeout=lambda: ""):
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            got = probe()
            if got:
                return got
            last = got
        except urllib.error.HTTPError as exc:
            if 400 <= exc.code < 500 and exc.code not in (401, 404):
                raise CheckFailed(f"{what}: HTTP {exc.code}: {exc.read()[:500]!r}") from exc
            last = exc
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            last = exc
        time.sleep(every_s)
    raise CheckFailed(f"{what}: not within {timeout_s:.0f} s (last: {last!r})\n{on_timeout()}")


def _log_line(entry) -> str:
    if not isinstance(entry, dict):
        return str(entry)
    rest = {k: v for k, v in entry.items() if k not in ("timestamp", "event", "level", "logger", "loc")}
    return " ".join(str(x) for x in (entry.get("level", ""), entry.get("event", ""), json.dumps(rest) if rest else "")
                    if x)


def task_log(stack: Stack, run_path: str, ti: dict, lines: int = 40) -> str:
    """The last lines of a task instance's log, through the REST API (as the UI shows it)."""
    try:
        got = stack.request("GET", f"{run_path}/taskInstances/{quote(ti['task_id'], safe='')}/logs/"
                                   f"{max(ti.get('try_number') or 1, 1)}?full_content=true")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"(no log: {exc!r})"
    content = got.get("content", got) if isinstance(got, dict) else got
    if isinstance(content, list):
        content = "\n".join(_log_line(e) for e in content)
    return "\n".join(str(content).splitlines()[-lines:])


PULLED = re.compile(r"pulled (\d+) file\(s\) from the results database")


def handed_over(stack: Stack, run_path: str, tis: list[dict]) -> str:
    """The celery pass's proof of the hand-over: the two workers mount different volumes at /var/lib/deploybench
    (docker inspect), and a task whose predecessor in time ran on the other worker says in its log that it pulled
    N > 0 files of the run from the results database (deploybench.store.run_files.pull). CheckFailed otherwise."""
    homes = {}
    for w in ("airflow-worker-1", "airflow-worker-2"):
        cid = stack.container(w)
        got = json.loads(run([DOCKER, "inspect", cid or w], 30, env=stack.d.env, quiet=True).stdout)[0]
        homes[w] = [m.get("Name") or m.get("Source") for m in got.get("Mounts", [])
                    if m.get("Destination") == "/var/lib/deploybench"]
    if any(len(v) != 1 for v in homes.values()) or homes["airflow-worker-1"] == homes["airflow-worker-2"]:
        raise CheckFailed(f"the workers' mounts at /var/lib/deploybench are not two different volumes: {homes}")
    ran = sorted((t for t in tis if t.get("hostname") and t.get("start_date") and t.get("state") == "success"),
                 key=lambda t: t["start_date"])
    tried = []
    for before, ti in zip(ran, ran[1:]):
        if before["hostname"] == ti["hostname"]:
            continue
        counts = [int(n) for n in PULLED.findall(task_log(stack, run_path, ti, lines=10_000))]
        tried.append(f"{ti['task_id']}@{ti['hostname']} after {before['task_id']}@{before['hostname']}: {counts}")
        if any(n > 0 for n in counts):
            return (f"worker disks {homes['airflow-worker-1']} and {homes['airflow-worker-2']}; "
                    f"{ti['task_id']} on {ti['hostname']} pulled {max(counts)} file(s) after {before['task_id']} "
                    f"ran on {before['hostname']}")
    raise CheckFailed("no task whose predecessor ran on the other worker logged a pull of any file: "
                      + ("; ".join(tried) or "no consecutive tasks on different workers"))


def check_stack(stack: Stack, steps: Steps) -> str:
    """Steps 3-9 on a built daemon (11 with the celery profile); returns the run id of the successful run."""
    if stack.celery:
        def named(what: str) -> str:
            return f"celery: {what}"
    else:
        def named(what: str) -> str:
            return what
    with steps(named("docker-compose config")):
        stack.compose("config", "--quiet", timeout=LIMITS_S["config"])
    with steps(named("docker-compose build (project image)")):
        stack.compose("build", "--quiet", "airflow-init", timeout=LIMITS_S["build"], quiet=True)
    with steps(named("docker-compose up -d")):
        stack.compose("up", "-d", "--no-build", timeout=LIMITS_S["up"], quiet=True)
    with steps(named("all services healthy, airflow-init exited 0")):
        def healthy():
            states = stack.health()
            if states["airflow-init"].startswith("exited") and states["airflow-init"] != "exited 0":
                raise CheckFailed(f"airflow-init failed: {states}\n{stack.logs(80)}")
            return all(states[s] == "healthy" for s in stack.services) and states["airflow-init"] == "exited 0" \
                and states
        log(f"services: {wait_for('healthy services', healthy, LIMITS_S['healthy'], 5, lambda: stack.logs())}")
    with steps(named("log in (POST /auth/token)")):
        wait_for("a token", stack.token, LIMITS_S["login"])
        version = stack.request("GET", "/api/v2/version")
        log(f"Airflow {version.get('version')} at {stack.url}")
    with steps(named(f"loopback lab {LAB!r} in the {stack.lab_service} container")):
        stack.compose("exec", "-T", stack.lab_service, "deploybench", "lab", "up", "--name", LAB, "--nodes", "2",
                      "--mode", "loopback", "--model-mb", "4", "--link-mbit", "200", timeout=LIMITS_S["lab"],
                      quiet=True)
    with steps(named(f"{DAG_ID} parsed and unpaused")):
        def parsed():
            errors = stack.request("GET", "/api/v2/importErrors")
            if errors.get("total_entries"):
                raise CheckFailed(f"import errors in the DAG folder: {errors['import_errors']}")
            return stack.request("GET", f"/api/v2/dags/{DAG_ID}")
        wait_for(f"{DAG_ID} parsed", parsed, LIMITS_S["dag"], 3, lambda: stack.logs())
        stack.request("PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})
    with steps(named(f"{DAG_ID}: a small run against simulated engines")):
        run_id = stack.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns",
                               {"logical_date": None, "conf": RUN_CONF})["dag_run_id"]
        path = f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}"
        state = wait_for(f"run {run_id}", lambda: (s := stack.request("GET", path)["state"]) in ("success", "failed")
                         and s, LIMITS_S["run"], 3, lambda: stack.logs())
        if state != "success":
            tis = stack.request("GET", f"{path}/taskInstances?limit=100")["task_instances"]
            failed = [t for t in tis if t["state"] == "failed" and t["task_id"] != "finish"]
            raise CheckFailed(f"run {run_id} ended {state}: " + ", ".join(
                f"{t['task_id']}={t['state']}" for t in tis if t["state"] != "success")
                + "".join(f"\n--- log of {t['task_id']}:\n{task_log(stack, path, t)}" for t in failed[:2]))
        log(f"run {run_id}: success")
    if stack.celery:
        with steps(named("the run's tasks ran on both workers")):
            tis = stack.request("GET", f"{path}/taskInstances?limit=100")["task_instances"]
            where = {t["task_id"]: t.get("hostname") or "" for t in tis if t.get("hostname")}
            hosts = sorted(set(where.values()))
            log("task -> worker: " + ", ".join(f"{t}@{h}" for t, h in where.items()))
            if len(hosts) < 2:
                raise CheckFailed(f"run {run_id}: its tasks ran on {hosts or 'no recorded host'}, not on two "
                                  f"workers: {where}")
            on_api = stack.compose("exec", "-T", "airflow-apiserver", "ls", "/var/lib/deploybench/runs",
                                   timeout=60, quiet=True, check=False).stdout or ""
            if f"{DAG_ID}__" in on_api:
                raise CheckFailed(f"the api-server's disk already holds a run folder ({on_api.strip()[:200]}): the "
                                  "results pages' pull from the database would not be tested")
            log(f"{len(where)} task instances on {len(hosts)} workers: {hosts}")
        with steps(named("the workers' disks differ and a task pulled what the other worker wrote")):
            log(handed_over(stack, path, tis))
    with steps(named("results pages answer with the run")):
        run_key = f"{DAG_ID}__{run_id}"
        runs = stack.request("GET", "/deploybench/api/runs")
        keys = [r.get("run_key") for r in (runs.get("runs", runs) if isinstance(runs, dict) else runs)]
        if run_key not in keys:
            raise CheckFailed(f"/deploybench/api/runs does not list {run_key}: {keys}")
        status, page = stack.request("GET", f"/deploybench/dag-runs/{DAG_ID}/{quote(run_id, safe='')}", raw=True)
        if status != 200 or run_id not in page:
            raise CheckFailed(f"the run's results page answered {status} without the run id")
        status, report = stack.request("GET", f"/deploybench/runs/{quote(run_key, safe='')}/report", raw=True)
        if status != 200 or "<html" not in report.lower():
            raise CheckFailed(f"the run's report answered {status}, not an HTML page")
        log(f"/deploybench/api/runs lists {run_key}; its page and its report answer 200")
    return run_id


def install_packages() -> None:
    missing = [p for p in PACKAGES if subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True,
                                                      text=True).stdout != "install ok installed"]
    if missing:
        log(f"installing {' '.join(missing)}")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run(["apt-get", "update", "-qq"], 300, env=env, quiet=True)
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], 600, env=env, quiet=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fresh", action="store_true", default=bool(os.environ.get("CI")),
                    help="a new daemon data-root, deleted afterwards: a cold run (default when $CI is set)")
    ap.add_argument("--install", action="store_true", help="apt-get install docker.io docker-compose debootstrap")
    ap.add_argument("--keep-up", action="store_true",
                    help="leave the stack and daemon running afterwards, passed or failed (for a person to look)")
    ap.add_argument("--celery", action="store_true",
                    help="after the default (LocalExecutor) pass, a second one with the CeleryExecutor profile")
    ap.add_argument("--celery-only", action="store_true", help="only the CeleryExecutor pass")
    args = ap.parse_args(argv)
    modes = [False] * (not args.celery_only) + [True] * (args.celery or args.celery_only)
    if os.geteuid() != 0:
        log("needs root (a private dockerd, debootstrap); run it as root, e.g. sudo make compose-check")
        return 2
    if args.install:
        install_packages()
    missing = [b for b in (DOCKER, DOCKERD, COMPOSE, DEBOOTSTRAP) if not Path(b).exists()]
    if missing:
        log(f"missing {', '.join(missing)}: apt-get install {' '.join(PACKAGES)} (or run with --install)")
        return 2

    def _terminate(signum, frame):
        raise CheckFailed(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    steps = Steps()
    cache = Path(os.environ.get("DEPLOYBENCH_COMPOSE_CACHE") or "/var/cache/deploybench-compose-check")
    work = Path(tempfile.mkdtemp(prefix="lc-compose-check-"))
    data_root = Path(tempfile.mkdtemp(prefix="lc-docker-", dir="/var/tmp")) if args.fresh else cache / "docker"
    exec_root = Path(tempfile.mkdtemp(prefix="lcdx", dir="/run"))  # short: containerd's sockets live here
    d = Dockerd(data_root, exec_root, work / "dockerd.log")
    stack: Stack | None = None
    ok = False
    log(f"{'cold (fresh data-root)' if args.fresh else 'warm cache'}: data-root {data_root}")
    try:
        with steps("start dockerd"):
            d.start(LIMITS_S["dockerd"])
        if not has_image(d, DEBIAN_IMAGE):
            with steps("base: debootstrap bookworm + docker import"):
                make_debian(d, work)
        if not all(has_image(d, ref) for ref, _ in standins(any(modes))):
            with steps("stand-in images (Airflow 3.3.2, PostgreSQL" + (", redis)" if any(modes) else ")")):
                build_standins(d, work, celery=any(modes))
        for celery in modes:
            if stack is not None:  # the previous pass's stack goes first: one stack at a time on this machine
                with steps("docker-compose down -v"):
                    stack.compose("down", "-v", "--remove-orphans", timeout=LIMITS_S["down"], quiet=True)
            stack = Stack(d, work, celery=celery)
            check_stack(stack, steps)
        ok = True
    except CheckFailed as exc:
        log(f"FAILED: {exc}")
    finally:
        if args.keep_up:
            log(f"left running: {stack.url if stack else ''} (DOCKER_HOST={d.env['DOCKER_HOST']}; "
                f"env file {stack.env_file if stack else ''}); stop with `docker-compose ... down -v` and SIGTERM to "
                f"dockerd pid {d.proc.pid if d.proc else ''}")
        else:
            if stack is not None:
                with steps("docker-compose down -v"):
                    try:
                        stack.compose("down", "-v", "--remove-orphans", timeout=LIMITS_S["down"], quiet=True)
                    except CheckFailed as exc:
                        log(f"down failed: {exc}")
                        ok = False
            with steps("stop dockerd, unmount, delete"):
                left = d.stop()
                if left:
                    log(f"still mounted: {left}")
                    ok = False
                shutil.rmtree(exec_root, ignore_errors=True)
                if args.fresh:
                    shutil.rmtree(data_root, ignore_errors=True)
                shutil.rmtree(work, ignore_errors=True) if ok else log(f"kept for a look: {work}")
        log("step times:\n" + steps.table())
        log("PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
