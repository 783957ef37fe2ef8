"""The production path's files, checked without starting anything (issue 16).

The real check — build the image, start the stack, run a benchmark through it — is
deploy/compose_check.py (`make compose-check`, in .ci/run). These tests catch in a second what would
otherwise surface minutes into that check: a compose file Docker Compose refuses, a component without a
health check or that starts before the init service, a credential written into a file, an image whose
Airflow version disagrees with requirements.txt, RBAC that misses a call the kubernetes backend makes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploybench.rollout import manifests

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yaml"
COMPONENTS = ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer")
ENV_EXAMPLE = ROOT / "deploy" / "compose.env.example"
MONITORING_SERVICES = {"prometheus", "grafana"}  # the optional `monitoring` profile
CELERY_SERVICES = {"redis", "airflow-worker-1", "airflow-worker-2"}  # the optional `celery` profile
sys_path_deploy = ROOT / "deploy"


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _airflow_pin() -> str:
    return re.search(r"^apache-airflow==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)


def test_compose_has_the_official_shape_and_every_component_waits_for_init_and_is_checked():
    everything = _compose()["services"]
    services = {k: v for k, v in everything.items() if not v.get("profiles")}  # what `up` starts by default
    assert set(services) == {"postgres", "airflow-init", *COMPONENTS}
    assert {k for k, v in everything.items() if v.get("profiles")} == MONITORING_SERVICES | CELERY_SERVICES
    for name in COMPONENTS:
        svc = services[name]
        assert svc["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully", name
        assert svc["depends_on"]["postgres"]["condition"] == "service_healthy", name
        assert svc["healthcheck"]["test"], name
        assert svc["environment"]["AIRFLOW__CORE__EXECUTOR"] == "${AIRFLOW_EXECUTOR:-LocalExecutor}", name
        mounts = {t: [mode] if mode else [] for t, mode in
                  (re.match(r"^.*:(/[^:]+)(?::(ro|rw))?$", m).groups() for m in svc["volumes"])}
        # what the components share: task logs, the run folders, the login; nodes' inventories/secrets read-only
        assert {"/opt/airflow/logs", "/var/lib/deploybench", "/opt/airflow/auth"} <= set(mounts), name
        assert mounts["/opt/deploybench/inventories"] == ["ro"] and mounts["/opt/deploybench/secrets"] == ["ro"], name
        assert svc["environment"]["DEPLOYBENCH_HOME"] == "/var/lib/deploybench", name
    assert services["postgres"]["healthcheck"]["test"]
    assert services["airflow-init"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["airflow-apiserver"]["command"] == "api-server"


def test_compose_holds_no_credential_each_one_comes_from_the_env_file():
    env = _compose()["services"]["airflow-scheduler"]["environment"]
    assert "${DEPLOYBENCH_RESULTS_PASSWORD:?" in env["AIRFLOW_CONN_DEPLOYBENCH_RESULTS"]
    assert "${POSTGRES_PASSWORD:?" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    assert env["AIRFLOW__API_AUTH__JWT_SECRET"].startswith("${AIRFLOW_JWT_SECRET:?")
    text = COMPOSE.read_text()
    for line in text.splitlines():
        if re.search(r"(?i)(password|secret)\w*:\s*\S", line) and not re.search(r"(?i)_FILE:", line) \
                and not line.lstrip().startswith("#"):
            assert "${" in line, f"a credential in docker-compose.yaml: {line.strip()}"


@pytest.mark.skipif(not shutil.which("docker-compose"),
                    reason="docker-compose not installed (.ci/bootstrap installs it)")
def test_docker_compose_accepts_the_file_with_the_example_env(tmp_path):
    """`docker-compose config` validates offline (exit 1 on an unknown key or a missing required variable)."""
    def config(env_file: Path) -> subprocess.CompletedProcess:
        return subprocess.run(["docker-compose", "--project-directory", str(ROOT), "-f", str(COMPOSE), "--env-file",
                               str(env_file), "config"], capture_output=True, text=True, timeout=60, cwd=ROOT)

    done = config(ENV_EXAMPLE)
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)
    assert resolved["services"]["airflow-scheduler"]["environment"]["AIRFLOW_CONN_DEPLOYBENCH_RESULTS"] == \
        "postgresql://deploybench:change-me-three@postgres:5432/deploybench"
    # without a password the file refuses to start, naming the variable
    no_pw = tmp_path / "env"
    no_pw.write_text("\n".join(line for line in ENV_EXAMPLE.read_text().splitlines()
                               if not line.startswith("POSTGRES_PASSWORD=")) + "\n")
    done = config(no_pw)
    assert done.returncode != 0 and "POSTGRES_PASSWORD" in done.stderr


def _mounts(svc: dict) -> dict[str, str]:
    """container path -> host path of a service's bind mounts (named volumes left out)."""
    out = {}
    for m in svc["volumes"]:
        host, target = m.split(":")[:2]
        if host.startswith(("./", "${")):
            out[target] = host
    return out


def test_the_monitoring_profile_loads_the_shipped_rules_config_and_dashboard():
    """Prometheus (built from the stand-in base with Debian's package) reads deploy/monitoring's prometheus.yml, and
    with it alerts.yml; Grafana (described only: no registry here) gets both datasources and the run dashboard."""
    services = _compose()["services"]
    prom, grafana = services["prometheus"], services["grafana"]
    assert prom["profiles"] == grafana["profiles"] == ["monitoring"]
    assert prom["build"]["context"] == "./deploy/standin" and prom["build"]["network"] == "host"
    dockerfile = (ROOT / "deploy" / "standin" / prom["build"]["dockerfile"]).read_text()
    assert "install -y -qq --no-install-recommends prometheus" in dockerfile
    config_flag = re.search(r'"--config\.file=([^"]+)"', dockerfile).group(1)
    folder, name = config_flag.rsplit("/", 1)
    host = _mounts(prom)[folder]
    assert (ROOT / host / name).is_file() and (ROOT / host / "alerts.yml").is_file()
    assert "alerts.yml" in yaml.safe_load((ROOT / host / name).read_text())["rule_files"]
    assert prom["healthcheck"]["test"] and "127.0.0.1:" in prom["ports"][0]  # published on the host only by default
    provisioning = ROOT / _mounts(grafana)["/etc/grafana/provisioning"]
    sources = yaml.safe_load((provisioning / "datasources" / "deploybench.yml").read_text())["datasources"]
    assert {d["type"] for d in sources} == {"prometheus", "grafana-postgresql-datasource"}
    assert next(d for d in sources if d["type"] == "prometheus")["url"] == "http://prometheus:9090"
    results = next(d for d in sources if d["type"] == "grafana-postgresql-datasource")
    assert results["secureJsonData"]["password"] == "$DEPLOYBENCH_RESULTS_PASSWORD"  # from the environment
    assert grafana["environment"]["DEPLOYBENCH_RESULTS_PASSWORD"].startswith("${DEPLOYBENCH_RESULTS_PASSWORD:?")
    provider = yaml.safe_load((provisioning / "dashboards" / "deploybench.yml").read_text())["providers"][0]
    dashboards = ROOT / next(h for t, h in _mounts(grafana).items() if t == provider["options"]["path"])
    board = json.loads((dashboards / "deploybench-run.json").read_text())
    used = {p["datasource"]["type"] for p in board["panels"]} | {
        a["datasource"]["type"] for a in board["annotations"]["list"]}
    assert used <= {d["type"] for d in sources}  # every datasource the dashboard asks for is provisioned
    # Grafana gets its own password file, not the secrets folder (which holds the nodes' SSH key)
    secret_mounts = [m for m in grafana["volumes"] if "SECRETS_DIR" in m or "secrets" in m]
    assert secret_mounts == ["${DEPLOYBENCH_SECRETS_DIR:-./secrets}/grafana-admin-password:"
                             "/run/secrets/grafana-admin-password:ro"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana-admin-password"


@pytest.mark.skipif(not shutil.which("docker-compose"),
                    reason="docker-compose not installed (.ci/bootstrap installs it)")
def test_docker_compose_accepts_the_monitoring_profile():
    done = subprocess.run(["docker-compose", "--project-directory", str(ROOT), "-f", str(COMPOSE), "--env-file",
                           str(ENV_EXAMPLE), "--profile", "monitoring", "config"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    assert resolved["prometheus"]["ports"] == ["127.0.0.1:9090:9090/tcp"]  # the example env's: the host only
    assert resolved["grafana"]["ports"] == ["127.0.0.1:3000:3000/tcp"]
    assert resolved["grafana"]["environment"]["DEPLOYBENCH_RESULTS_PASSWORD"] == "change-me-three"


@pytest.mark.skipif(not shutil.which("docker-compose"),
                    reason="docker-compose not installed (.ci/bootstrap installs it)")
def test_the_celery_profile_gives_each_worker_its_own_disk_and_both_the_lab(tmp_path):
    """Two Celery workers with a deploybench home each (no run folder shared on disk: runs travel through the
    results database), the lab's volume mounted by the workers only, worker 2 in worker 1's network and process
    namespaces (the lab's engines on 127.0.0.x), each naming itself; the executor switched by AIRFLOW_EXECUTOR."""
    env = tmp_path / "celery.env"
    env.write_text(ENV_EXAMPLE.read_text() + "AIRFLOW_EXECUTOR=CeleryExecutor\n")
    done = subprocess.run(["docker-compose", "--project-directory", str(ROOT), "-f", str(COMPOSE), "--env-file",
                           str(env), "--profile", "celery", "config"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    assert set(resolved) >= CELERY_SERVICES
    assert resolved["airflow-scheduler"]["environment"]["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    # the broker behind the .env's password (a Celery message carries its task's Execution-API token)
    redis = resolved["redis"]
    assert redis["command"][:2] == ["--requirepass", "change-me-four"], redis["command"]
    assert redis["command"][redis["command"].index("--protected-mode") + 1] == "yes"
    assert redis["environment"]["REDISCLI_AUTH"] == "change-me-four"
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert resolved["airflow-scheduler"]["environment"]["AIRFLOW__CELERY__BROKER_URL"] == \
        "redis://:change-me-four@redis:6379/0"
    # run folders: the workers through the results database, the api-server reads it, the rest share one volume
    run_files = {n: s["environment"].get("DEPLOYBENCH_RUN_FILES") for n, s in resolved.items()
                 if n.startswith("airflow")}
    assert run_files["airflow-worker-1"] == run_files["airflow-worker-2"] == run_files["airflow-apiserver"] == \
        "database", run_files
    assert run_files["airflow-scheduler"] == "shared", run_files
    no_pw = tmp_path / "no-redis.env"
    no_pw.write_text("".join(line + "\n" for line in env.read_text().splitlines()
                             if not line.startswith("REDIS_PASSWORD=")))
    refused = subprocess.run(["docker-compose", "--project-directory", str(ROOT), "-f", str(COMPOSE), "--env-file",
                              str(no_pw), "--profile", "celery", "config"], capture_output=True, text=True,
                             timeout=60, cwd=ROOT)
    assert refused.returncode != 0 and "REDIS_PASSWORD" in refused.stderr

    def mounts(name: str) -> dict[str, str]:
        # compose v1 prints "source:target[:mode]" (a bind's source an absolute path, a volume's its name)
        return {v.split(":")[1]: v.split(":")[0] for v in resolved[name].get("volumes", [])}

    workers = ("airflow-worker-1", "airflow-worker-2")
    homes = {w: mounts(w)["/var/lib/deploybench"] for w in workers}
    assert len(set(homes.values())) == 2 and "deploybench-home" not in homes.values(), homes
    lab = {w: mounts(w).get("/var/lib/deploybench/lab") for w in workers}
    assert lab["airflow-worker-1"] == lab["airflow-worker-2"] == "deploybench-lab"
    assert not [n for n in resolved if n not in workers and "deploybench-lab" in mounts(n).values()]
    assert resolved["airflow-worker-2"]["network_mode"] == resolved["airflow-worker-2"]["pid"] == \
        "service:airflow-worker-1"
    names = {resolved[w]["environment"]["DEPLOYBENCH_WORKER_NAME"] for w in workers}
    assert names == set(workers)
    for w in workers:
        assert resolved[w]["environment"]["AIRFLOW__CORE__HOSTNAME_CALLABLE"] == \
            "deploybench.airflow.home.worker_hostname"
        assert resolved[w]["depends_on"]["redis"]["condition"] == "service_healthy"
        assert f"--celery-hostname {w}@%h" in resolved[w]["command"]


def test_image_and_stand_in_install_the_airflow_version_requirements_pins():
    pin = _airflow_pin()
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"ARG AIRFLOW_IMAGE=apache/airflow:{pin}-python3.11" in dockerfile
    assert f"ARG AIRFLOW_VERSION={pin}" in dockerfile
    assert f"ARG AIRFLOW_VERSION={pin}" in (ROOT / "deploy" / "standin" / "airflow.Dockerfile").read_text()
    assert f"apache/airflow:{pin}-python3.11" in _compose()["x-airflow-common"]["build"]["args"]["AIRFLOW_IMAGE"]


def test_the_build_context_holds_what_the_dockerfile_copies():
    """Every COPY source of ./Dockerfile is let through by .dockerignore (a missing one fails the build)."""
    allowed = [ln[1:].rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.startswith("!")]
    sources = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY"):
            words = [w for w in line.split()[1:] if not w.startswith("--")]
            sources += words[:-1]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert any(src == a or src.startswith(a + "/") for a in allowed), f"{src} is not in the build context"


def _image_constraints():
    import importlib.util

    spec = importlib.util.spec_from_file_location("image_constraints", sys_path_deploy / "image_constraints.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_constraints_where_they_apply_requirements_pins_win_and_differences_are_named():
    mod = _image_constraints()
    constraints = "# header\nSQLAlchemy==2.0.41\npandas==2.3.1\nrich==14.0.0\nzope.event==5.0\n"
    requirements = "apache-airflow==3.3.2\nsqlalchemy==2.1.9\npsycopg[binary]==3.3.9\nPandas==2.3.1\n"
    text, dropped = mod.without_pinned(constraints, requirements)
    assert "rich==14.0.0" in text and "zope.event==5.0" in text and "# header" in text
    assert "SQLAlchemy" not in text and "pandas" not in text
    assert dropped == [("sqlalchemy", "2.0.41", "2.1.9"), ("pandas", "2.3.1", "2.3.1")]


def test_the_image_installs_the_runtime_set_as_it_stands_and_no_test_or_lint_set():
    """./Dockerfile pip-installs requirements-extras.txt itself (no filtered copy): with the requirements.txt it
    includes, every pin of the runtime set and its optional parts, and none of the test and lint sets."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"pip install [^\n]*-r /opt/deploybench/requirements-extras\.txt", dockerfile)
    assert "requirements-test" not in dockerfile and "requirements-lint" not in dockerfile
    mod = _image_constraints()
    image = set(mod.pins(mod.requirements_text(ROOT / "requirements-extras.txt")))
    ours = {f: set(mod.pins((ROOT / f).read_text())) for f in
            ("requirements.txt", "requirements-extras.txt", "requirements-test.txt", "requirements-lint.txt")}
    assert image == ours["requirements.txt"] | ours["requirements-extras.txt"]
    assert {"apache-airflow", "apache-airflow-providers-ssh", "apache-airflow-providers-cncf-kubernetes",
            "apache-airflow-providers-postgres", "k6", "psycopg", "paramiko", "pydantic"} <= image
    assert not image & (ours["requirements-test.txt"] | ours["requirements-lint.txt"])


def test_helm_values_use_this_image_and_mount_inventories_and_secrets_read_only():
    values = yaml.safe_load((ROOT / "deploy" / "helm" / "values.yaml").read_text())
    assert values["executor"] == "LocalExecutor" and values["airflowVersion"] == _airflow_pin()
    assert values["images"]["airflow"]["repository"] == values["defaultAirflowRepository"]
    mounts = {m["mountPath"]: m for m in values["volumeMounts"]}
    assert mounts["/opt/deploybench/inventories"]["readOnly"] and mounts["/opt/deploybench/secrets"]["readOnly"]
    assert not mounts["/var/lib/deploybench"].get("readOnly")
    volumes = {v["name"] for v in values["volumes"]}
    assert {m["name"] for m in values["volumeMounts"]} <= volumes
    envs = {s["envName"] for s in values["secret"]}
    assert {"AIRFLOW_CONN_DEPLOYBENCH_RESULTS", "AIRFLOW_CONN_DEPLOYBENCH_SSH",
            "AIRFLOW_CONN_KUBERNETES_DEFAULT"} <= envs
    assert values["config"]["core"]["dags_folder"] == "/opt/deploybench/dags"


def _k8s_objects() -> list[dict]:
    return [o for o in yaml.safe_load_all((ROOT / "deploy" / "helm" / "deploybench-rbac.yaml").read_text()) if o]


def test_kubernetes_objects_are_valid_against_the_official_schemas():
    objs = _k8s_objects()
    assert {o["kind"] for o in objs} == {"Namespace", "Role", "RoleBinding", "PersistentVolumeClaim"}
    for obj in objs:
        manifests.validate(obj)


_VERBS = {"read": "get", "list": "list", "patch": "patch", "delete": "delete", "create": "create", "replace": "update"}


def test_the_role_allows_every_call_the_kubernetes_backend_makes():
    """Each ``kube.apps.<verb>_namespaced_<kind>`` / ``kube.core...`` call in deploybench.rollout maps to a rule."""
    calls = set()
    for path in (ROOT / "include" / "deploybench" / "rollout").glob("*.py"):
        calls |= set(re.findall(r"kube\.(apps|core|policy|autoscaling)\.(\w+?)_namespaced_(\w+)", path.read_text()))
    assert len(calls) >= 8
    role = next(o for o in _k8s_objects() if o["kind"] == "Role")
    allowed = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    plural = {"deployment": "deployments", "service": "services", "config_map": "configmaps", "pod": "pods",
              "deployment_scale": "deployments/scale", "pod_log": "pods/log",
              "pod_disruption_budget": "poddisruptionbudgets", "horizontal_pod_autoscaler": "horizontalpodautoscalers"}
    for api, verb, kind in sorted(calls):
        group = {"apps": "apps", "policy": "policy", "autoscaling": "autoscaling"}.get(api, "")
        need = (group, plural[kind], _VERBS[verb])
        assert need in allowed, f"kube.{api}.{verb}_namespaced_{kind} needs {need} in the Role"
    binding = next(o for o in _k8s_objects() if o["kind"] == "RoleBinding")
    values = yaml.safe_load((ROOT / "deploy" / "helm" / "values.yaml").read_text())
    assert binding["subjects"][0]["name"] == values["scheduler"]["serviceAccount"]["name"]
