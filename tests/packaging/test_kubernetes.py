"""deploy/kubernetes and packaging/container agree with Kubernetes, with numa-infer and with each other.

The kustomize base is rendered with the real `kubectl kustomize` (offline), every object
is checked against the Kubernetes API schema with kubernetes-validate (offline, bundled
schemas), the ConfigMap's numa-infer.toml goes through numa-infer's own parser, the
probes through numa-infer's own argument parser, and the Containerfile's ENTRYPOINT
through both.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml  # a dependency of kubernetes-validate (and of gguf)

# Not skipped when missing: a schema check that silently does not run protects nothing.
# Imported here rather than at the top so that its absence fails the schema tests, not the
# collection of the whole suite.
try:
    import kubernetes_validate
except ImportError:  # pragma: no cover - the project's test dependencies carry it
    kubernetes_validate = None

from numad_infer.cli.main import build_parser
from numad_infer.config.defaults import stop_bound_s
from numad_infer.config.load import parse_config
from numad_infer.config.schema import Config
from numad_infer.config.values import parse_listen

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes"
MODEL_PVC = BASE / "components" / "model-pvc"
TWO_SOCKET = BASE / "components" / "two-socket"
SECCOMP_LOCALHOST = BASE / "components" / "seccomp-localhost"
PODMONITOR = BASE / "optional" / "podmonitor.yaml"
PROMETHEUSRULE = BASE / "optional" / "prometheusrule.yaml"
NETWORKPOLICY = BASE / "optional" / "networkpolicy.yaml"
RULES = ROOT / "packaging" / "prometheus" / "numa-infer-rules.yml"
CONTAINERFILE = ROOT / "packaging" / "container" / "Containerfile"
DEBIAN_PACKAGES = ROOT / "packaging" / "container" / "debian-packages"

# The oldest Kubernetes the manifests promise to suit (stable fields only), and the newest
# schema the installed kubernetes-validate carries.
SCHEMA_VERSIONS = ("1.29.0", "latest")


STATE_DIR = "/var/lib/numa-infer"
CONFIG_PATH = "/etc/numa-infer.toml"


def kustomize(directory: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` renders deploy/kubernetes")
    done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return kustomize(BASE)


def with_components(tmp_path_factory: pytest.TempPathFactory, *components: Path) -> list[dict]:
    # An overlay outside the base, as the components' comments tell operators to write
    # (kustomize refuses an overlay inside its base's directory, and absolute paths).
    overlay = tmp_path_factory.mktemp("overlay")
    base = os.path.relpath(BASE, overlay)
    listed = "".join(f"  - {os.path.relpath(c, overlay)}\n" for c in components)
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {base}\ncomponents:\n{listed}")
    return kustomize(overlay)


@pytest.fixture(scope="module")
def rendered_with_pvc(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return with_components(tmp_path_factory, MODEL_PVC)


@pytest.fixture(scope="module")
def rendered_two_socket(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return with_components(tmp_path_factory, TWO_SOCKET, SECCOMP_LOCALHOST)


def only(objects: list[dict], kind: str) -> dict:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, rendered {[o['kind'] for o in objects]}"
    return found[0]


def pod_spec(objects: list[dict]) -> dict:
    return only(objects, "DaemonSet")["spec"]["template"]["spec"]


def container(objects: list[dict]) -> dict:
    containers = pod_spec(objects)["containers"]
    assert len(containers) == 1, "numa-infer's pod has one container: the daemon, its instances and HAProxy"
    return containers[0]


def config_of(objects: list[dict]) -> Config:
    configmap = only(objects, "ConfigMap")
    assert "numa-infer.toml" in configmap["data"]
    return parse_config(configmap["data"]["numa-infer.toml"], "ConfigMap numa-infer.toml")


def probes(objects: list[dict]) -> dict[str, list[str]]:
    c = container(objects)
    found = {name: c[name]["exec"]["command"] for name in ("startupProbe", "livenessProbe", "readinessProbe") if name in c}
    assert {"livenessProbe", "readinessProbe"} <= found.keys()
    return found


def option(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def containerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the final stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    pairs = [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]
    last_from = max(i for i, (ins, _) in enumerate(pairs) if ins == "FROM")
    return pairs[last_from:]


def containerfile_all() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def entrypoint() -> list[str]:
    [args] = [a for ins, a in containerfile_instructions() if ins == "ENTRYPOINT"]
    return json.loads(args)


# -- Kubernetes --------------------------------------------------------------------------------------------

def test_base_renders_a_daemonset_its_configmap_and_a_service(rendered: list[dict]) -> None:
    assert sorted(o["kind"] for o in rendered) == ["ConfigMap", "DaemonSet", "Service"]
    configmap = only(rendered, "ConfigMap")
    volumes = {v["name"]: v for v in pod_spec(rendered)["volumes"]}
    # configMapGenerator's hashed name, referenced from the pod: editing the config rolls the pods.
    assert volumes["config"]["configMap"]["name"] == configmap["metadata"]["name"] != "numa-infer-config"


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_every_rendered_object_is_valid_against_the_kubernetes_schema(
        rendered: list[dict], rendered_with_pvc: list[dict], rendered_two_socket: list[dict], version: str) -> None:
    assert kubernetes_validate is not None, (
        "kubernetes-validate is not installed: it is a test dependency (pip install kubernetes-validate)")
    if version == "latest":
        version = kubernetes_validate.latest_version()
    optional = [yaml.safe_load(NETWORKPOLICY.read_text())]  # kinds of the API itself (not an operator's CRD)
    for obj in (rendered + [o for o in rendered_with_pvc if o["kind"] == "PersistentVolumeClaim"] + optional
                + [only(rendered_two_socket, "DaemonSet")]):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except Exception as exc:  # kubernetes_validate's own errors, and jsonschema's in strict mode
            where = ".".join(str(p) for p in getattr(exc, "path", ()))
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']} is invalid for Kubernetes {version}: "
                        f"{where}: {getattr(exc, 'message', exc)}")


def test_daemonset_runs_one_pod_on_each_labelled_node_only(rendered: list[dict]) -> None:
    assert pod_spec(rendered)["nodeSelector"] == {"numa-infer.io/enabled": "true"}
    daemonset = only(rendered, "DaemonSet")
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert only(rendered, "Service")["spec"]["selector"].items() <= labels.items()


def test_pod_is_in_the_guaranteed_qos_class_with_whole_cpus(rendered: list[dict]) -> None:
    # The static CPU manager gives exclusive CPUs only to Guaranteed pods asking for whole CPUs;
    # without them numa-infer's pinning would share cores with every other pod.
    spec = pod_spec(rendered)
    for c in spec["containers"] + spec.get("initContainers", []):
        resources = c["resources"]
        for resource in ("cpu", "memory"):
            assert resources["requests"][resource] == resources["limits"][resource], f"{c['name']}: {resource}"
        cpu = str(resources["limits"]["cpu"])
        assert re.fullmatch(r"[1-9][0-9]*", cpu), f"{c['name']}: cpu {cpu!r} is not a whole number of CPUs"


def test_pod_runs_unprivileged_with_a_read_only_root_and_writable_state_and_tmp(rendered: list[dict]) -> None:
    spec = pod_spec(rendered)
    pod_sc = spec["securityContext"]
    assert pod_sc["runAsNonRoot"] is True
    assert isinstance(pod_sc["runAsUser"], int) and pod_sc["runAsUser"] > 0
    c = container(rendered)
    sc = c["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc.get("runAsUser", pod_sc["runAsUser"]) == pod_sc["runAsUser"]
    assert not sc.get("privileged", False)
    volumes = {v["name"]: v for v in spec["volumes"]}
    writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
    assert writable == {STATE_DIR, "/tmp"}, "only the state directory and /tmp are written"
    for mount in c["volumeMounts"]:
        if mount["mountPath"] in writable:
            assert "emptyDir" in volumes[mount["name"]], f"{mount['mountPath']} should be an emptyDir"


def test_grace_period_covers_the_drain_timeout_and_stopping_every_instance(rendered: list[dict]) -> None:
    config = config_of(rendered)
    grace = pod_spec(rendered)["terminationGracePeriodSeconds"]
    assert grace >= config.frontend.drain_timeout_s
    pre_stop = container(rendered).get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_stop_s = int(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0
    assert not pre_stop or pre_stop_s, f"a preStop hook the test cannot time: {pre_stop}"
    # What the daemon takes from SIGTERM to exit (numad_infer/config/defaults.py), whatever the
    # number of instances: they stop all at once.
    assert grace >= pre_stop_s + stop_bound_s(config.frontend.drain_timeout_s)


def test_configmap_holds_a_valid_process_backend_llama_server_config(rendered: list[dict]) -> None:
    config = config_of(rendered)
    assert config.server.engine == "llama-server"
    assert config.server.llama_server == "/usr/local/lib/llama-server/llama-server"
    assert config.frontend.enabled, "the Service needs the front door"
    assert config.metrics.listen, "the scrape annotations need the metrics endpoint"
    assert parse_listen(config.frontend.listen)[0] == "0.0.0.0"
    assert parse_listen(config.metrics.listen)[0] == "0.0.0.0"
    mounts = {m["mountPath"]: m for m in container(rendered)["volumeMounts"]}
    assert config.model.path.startswith("/models/") and mounts["/models"]["readOnly"] is True
    assert mounts[CONFIG_PATH]["subPath"] == "numa-infer.toml"


def test_every_port_in_the_manifests_is_the_port_the_config_listens_on(rendered: list[dict]) -> None:
    config = config_of(rendered)
    http = parse_listen(config.frontend.listen)[1]
    metrics = parse_listen(config.metrics.listen)[1]
    ports = {p["name"]: p["containerPort"] for p in container(rendered)["ports"]}
    assert ports == {"http": http, "metrics": metrics}
    for port in only(rendered, "Service")["spec"]["ports"]:
        target = port["targetPort"]
        assert ports.get(target, target) == http, f"Service port {port['name']} targets {target}"
    annotations = only(rendered, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == metrics
    assert annotations["prometheus.io/path"] == "/metrics"
    [endpoint] = yaml.safe_load(PODMONITOR.read_text())["spec"]["podMetricsEndpoints"]
    assert ports[endpoint["port"]] == metrics


def test_the_two_socket_example_asks_for_whole_cores_of_both_nodes_under_numa_infers_seccomp_profile(
        rendered_two_socket: list[dict]) -> None:
    (container,) = pod_spec(rendered_two_socket)["containers"]
    resources = container["resources"]
    assert resources["requests"] == resources["limits"]  # Guaranteed: the static CPU manager's own CPUs
    cpus = int(resources["requests"]["cpu"])
    assert cpus % 4 == 0  # whole cores (2 SMT siblings) on each of the 2 nodes
    profile = pod_spec(rendered_two_socket)["securityContext"]["seccompProfile"]
    assert profile == {"type": "Localhost", "localhostProfile": "profiles/numa-infer.json"}
    # The install step the component and the README give puts the shipped file at that path.
    install = "/var/lib/kubelet/seccomp/" + profile["localhostProfile"]
    assert install in (SECCOMP_LOCALHOST / "kustomization.yaml").read_text()
    assert install in (BASE / "seccomp" / "README.md").read_text()
    assert (BASE / "seccomp" / "numa-infer.json").is_file()


def test_the_base_sizes_are_marked_as_placeholders() -> None:
    assert "PLACEHOLDERS: size them to the node" in (BASE / "daemonset.yaml").read_text()


def test_the_networkpolicy_admits_the_front_door_and_metrics_ports_of_the_pods_it_selects(
        rendered: list[dict]) -> None:
    policy = yaml.safe_load(NETWORKPOLICY.read_text())
    labels = only(rendered, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"]: p["containerPort"] for c in pod_spec(rendered)["containers"] for p in c.get("ports", [])}
    admitted = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert admitted == {ports["http"], ports["metrics"]}


def test_the_networkpolicy_lets_only_the_monitoring_namespaces_prometheus_reach_the_metrics_port(
        rendered: list[dict]) -> None:
    policy = yaml.safe_load(NETWORKPOLICY.read_text())
    metrics = {p["name"]: p["containerPort"] for p in container(rendered)["ports"]}["metrics"]
    # A rule without `from`, or a peer with an empty selector, admits every pod; a policy
    # does not apply at all to a pod on the host's network.
    assert all(rule.get("from") for rule in policy["spec"]["ingress"])
    assert not pod_spec(rendered).get("hostNetwork")
    [rule] = [r for r in policy["spec"]["ingress"] if metrics in {p["port"] for p in r["ports"]}]
    assert [p["port"] for p in rule["ports"]] == [metrics]
    for peer in rule["from"]:
        # Both selectors in one peer: a pod of that namespace AND with that label, never either.
        assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
        assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}


def test_the_prometheusrule_carries_the_shipped_rules_and_selects_the_podmonitors_pods_job_or_any() -> None:
    rule = yaml.safe_load(PROMETHEUSRULE.read_text())
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    # The PodMonitor's job is NAMESPACE/numa-infer: a rule that names a job would match nothing.
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert exprs and not any("job=" in e for e in exprs)
    monitor = yaml.safe_load(PODMONITOR.read_text())
    assert monitor["metadata"]["labels"] == rule["metadata"]["labels"]


def test_probes_read_the_state_file_the_daemon_writes(rendered: list[dict]) -> None:
    for name, argv in probes(rendered).items():
        assert argv[0] == "numa-infer", name
        assert option(argv, "--state-file") == option(entrypoint(), "--state-file"), name
        assert option(argv, "--state-file").startswith(STATE_DIR + "/"), name


def test_probe_commands_are_numa_infer_subcommands_the_cli_knows(rendered: list[dict]) -> None:
    parser = build_parser()
    seen = set()
    for name, argv in probes(rendered).items():
        try:
            args = parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{name}: numa-infer refuses {' '.join(argv[1:])}")
        seen.add((args.command, bool(getattr(args, "live", False)), bool(getattr(args, "ready", False))))
    assert ("health", True, False) in seen, "liveness: numa-infer health --live"
    assert ("health", False, True) in seen, "readiness: numa-infer health --ready"


def test_model_pvc_component_swaps_the_hostpath_for_a_read_only_claim(rendered: list[dict],
                                                                      rendered_with_pvc: list[dict]) -> None:
    default = {v["name"]: v for v in pod_spec(rendered)["volumes"]}["models"]
    assert default["hostPath"]["type"] == "Directory"
    models = {v["name"]: v for v in pod_spec(rendered_with_pvc)["volumes"]}["models"]
    assert "hostPath" not in models
    claim = only(rendered_with_pvc, "PersistentVolumeClaim")
    assert models["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"], "readOnly": True}
    # Every node's pod mounts the same claim.
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]


# -- the container image -----------------------------------------------------------------------------------

def test_containerfile_entrypoint_runs_the_process_backend_under_tini_with_the_manifests_paths(
        rendered: list[dict]) -> None:
    argv = entrypoint()
    assert argv[:2] == ["/usr/bin/tini", "--"], "tini is PID 1: reaps orphans, forwards SIGTERM"
    assert argv[2] == "/usr/local/bin/numa-infer"
    args = build_parser().parse_args(argv[3:])
    assert (args.command, args.backend) == ("run", "process")
    assert args.instance_logs == "stdout", "no journal in a container: the instances' output goes to stdout"
    assert args.config == CONFIG_PATH
    mounts = {m["mountPath"] for m in container(rendered)["volumeMounts"]}
    assert CONFIG_PATH in mounts
    assert str(Path(args.state_file).parent) in mounts
    c = container(rendered)
    assert "command" not in c and "args" not in c, "the pod runs the image's ENTRYPOINT as it is"


def test_containerfile_user_volume_ports_and_binaries_match_the_manifests_and_config(rendered: list[dict]) -> None:
    final = containerfile_instructions()
    [user] = [a for ins, a in final if ins == "USER"]
    uid, _, gid = user.partition(":")
    pod_sc = pod_spec(rendered)["securityContext"]
    assert (int(uid), int(gid)) == (pod_sc["runAsUser"], pod_sc["runAsGroup"])
    [volume] = [json.loads(a) for ins, a in final if ins == "VOLUME"]
    assert volume == [STATE_DIR]
    [exposed] = [a.split() for ins, a in final if ins == "EXPOSE"]
    assert sorted(int(p) for p in exposed) == sorted(p["containerPort"] for p in container(rendered)["ports"])
    copies = {a.split()[-1]: a.split()[-2] for ins, a in containerfile_all() if ins == "COPY"}
    config = config_of(rendered)
    # The configured binary sits in the directory the image copies whole (its libraries and
    # CPU variants beside it).
    llama_dir = config.server.llama_server.rsplit("/", 1)[0] + "/"
    assert copies[llama_dir] == "llama-server/"
    assert copies[entrypoint()[2]] == "bin/numa-infer"
    assert "--chown=65532:65532" in next(a for ins, a in containerfile_all() if ins == "COPY" and a.endswith(STATE_DIR + "/"))
    packages = {line.strip() for line in DEBIAN_PACKAGES.read_text().splitlines() if line.strip() and not line.startswith("#")}
    assert {"python3-pydantic", "python3-psutil", "python3-sdnotify", "python3-prometheus-client", "python3-tomlkit",
            "haproxy", "tini", "libgomp1"} <= packages
    assert config.frontend.haproxy == "/usr/sbin/haproxy"  # where Debian's haproxy puts it


def test_default_image_build_runs_nothing_inside_the_image() -> None:
    # podman cannot run a RUN step where crun refuses the host's cgroups (v1/hybrid); the
    # default stages (DEBIAN_PACKAGES=baked, LLAMA_CPP_PYTHON=off) must need none.
    stages: dict[str, list[str]] = {}
    current = ""
    args = {}
    for ins, a in containerfile_all():
        if ins == "ARG" and "=" in a and not stages:
            name, _, value = a.partition("=")
            args[name] = value
        elif ins == "FROM":
            source, _, current = a.partition(" AS ")
            stages[current.strip()] = [source.strip()]
        elif current:
            stages[current.strip()].append(ins)
    assert args["DEBIAN_PACKAGES"] == "baked" and args["LLAMA_CPP_PYTHON"] == "off"
    used, todo = [], [k for k in stages if k == ""]
    while todo:
        stage = todo.pop()
        used.append(stage)
        source = stages[stage][0]
        for name, value in args.items():
            source = source.replace("${" + name + "}", value)
        if source in stages:
            todo.append(source)
    assert set(used) == {"", "llama-cpp-python-off", "app", "packages-baked"}
    assert all("RUN" not in stages[s][1:] for s in used)
