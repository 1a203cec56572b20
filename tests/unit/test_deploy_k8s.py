"""`ferry deploy k8s`: manifests valid for Kubernetes 1.31 (kubernetes-validate's schemas, the
LWS CRDs' for LeaderWorkerSet and DisaggregatedSet), whose pods run the flags `ferry up` would
give the same processes, and whose Services, probes and budgets reach the pods they name."""

from __future__ import annotations

import copy
import gzip
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from ferry.infra import cli
from ferry.infra.deploy.k8s import HEADER

CRDS = Path(__file__).resolve().parents[1] / "data" / "k8s-crds"
K8S_VERSION = "1.31.0"
SHAPES = {
    "defaults": [],
    "wide": [
        *("--prefill", "2", "--decode", "2", "--prefill-dep", "2", "--decode-dep", "4"),
        *("--num-redundant-experts", "8", "--schedulers", "2", "--redis-url", "redis://r:6379/0"),
        *("--routing-policy", "least_loaded", "--migration-limit", "2", "--cluster", "blue"),
    ],
    "gpus": [
        *("--aggregated", "2", "--gpus", "8", "--rdma-resource", "rdma/ib", "--host-network"),
        *("--ucx-tls", "rc,cuda_copy", "--node-selector", "gpu=h100", "--tls-secret", "ferry-tls"),
        *("--api-key-secret", "ferry-key", "--metrics-auth", "--pod-monitor"),
        *("--gateway-replicas", "2", "--gateway-service-type", "LoadBalancer"),
    ],
    "disaggregated-set": ["--prefill-dep", "2", "--decode-dep", "2", "--disaggregated-set"],
    "checkpoint": ["--model", "/models/deepseek-v3", "--model-pvc", "weights", "--decode", "3"],
}
WORKLOADS = {"Deployment", "StatefulSet", "LeaderWorkerSet"}


def _render(tmp_path: Path, argv: list[str]) -> list[dict[str, Any]]:
    out = tmp_path / "manifests"
    assert cli.main(["deploy", "k8s", *argv, "--out", str(out)]) == 0
    objects = []
    for path in sorted(out.glob("*.yaml")):
        docs = list(yaml.safe_load_all(path.read_text()))
        assert len(docs) == 1 and isinstance(docs[0], dict), f"{path.name}: one object"
        objects.append(docs[0])
    return objects


def _crd_schema(name: str) -> dict[str, Any]:
    with gzip.open(CRDS / f"{name}.yaml.gz", "rt") as f:
        crd = yaml.safe_load(f)
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    return _closed(version["schema"]["openAPIV3Schema"])


def _closed(schema: Any) -> Any:
    """The API server prunes fields a CRD does not declare; a typo would vanish silently. Here
    an undeclared field fails, as kubernetes-validate's strict schemas fail it."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if "properties" in out and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def _validate(obj: dict[str, Any], crds: dict[str, dict[str, Any]]) -> None:
    kind = obj["kind"]
    if kind in crds:
        jsonschema.validate(obj, crds[kind])
    elif kind == "PodMonitor":  # the Prometheus Operator's CRD is not here: its own fields
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(obj["spec"]) == {"selector", "podMetricsEndpoints"}
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.fixture(scope="module")
def crds() -> dict[str, dict[str, Any]]:
    return {
        "LeaderWorkerSet": _crd_schema("leaderworkerset.x-k8s.io_leaderworkersets"),
        "DisaggregatedSet": _crd_schema("disaggregatedset.x-k8s.io_disaggregatedsets"),
    }


def _templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates of a workload."""
    if obj["kind"] in ("Deployment", "StatefulSet"):
        return [obj["spec"]["template"]]
    if obj["kind"] == "LeaderWorkerSet":
        return [obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]]
    if obj["kind"] == "DisaggregatedSet":
        return [r["spec"]["leaderWorkerTemplate"]["workerTemplate"] for r in obj["spec"]["roles"]]
    return []


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_object_is_valid_kubernetes_1_31(
    shape: str, tmp_path: Path, crds: dict[str, dict[str, Any]]
) -> None:
    objects = _render(tmp_path, SHAPES[shape])
    for obj in objects:
        _validate(obj, crds)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget"} <= kinds
    assert ("StatefulSet" in kinds) == ("--redis-url" not in SHAPES[shape])  # its own Redis


def test_the_validators_would_say_so(tmp_path: Path, crds: dict[str, dict[str, Any]]) -> None:
    """Both validators read what they are given: a wrong field fails each."""
    objects = _render(tmp_path, ["--decode-dep", "2"])
    deployment = copy.deepcopy(next(o for o in objects if o["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["port"] = 1  # not "ports"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment, crds)
    lws = copy.deepcopy(next(o for o in objects if o["kind"] == "LeaderWorkerSet"))
    lws["spec"]["leaderWorkerTemplate"]["size"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        _validate(lws, crds)
    lws["spec"]["leaderWorkerTemplate"]["size"] = 2
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Sometimes"
    with pytest.raises(jsonschema.ValidationError):
        _validate(lws, crds)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_pods_run_what_ferry_up_would_start(shape: str, tmp_path: Path) -> None:
    """One ClusterSpec: every pod's argv is `ferry serve ROLE` with that role's flags from
    `cluster_spec` (the flags ferry up gives its children), and `ferry serve` takes it; every
    FERRY_* variable is a flag's."""
    args = cli.build_parser().parse_args(["deploy", "k8s", *SHAPES[shape], "--out", "x"])
    spec = cli.cluster_spec(args, worker_cores=args.worker_cpus)
    objects = _render(tmp_path, SHAPES[shape])
    roles = set()
    for obj in objects:
        for template in _templates(obj):
            for c in template["spec"]["containers"]:
                if c["name"] == "redis":
                    continue
                argv = c["args"]
                assert argv[:2] == ["serve", c["name"]]
                roles.add(c["name"])
                theirs = spec.serve_args[c["name"]]
                assert any(argv[i : i + len(theirs)] == theirs for i in range(len(argv))), argv
                expanded = [re.sub(r"\$\((\w+)\)", "x", a) for a in argv]
                parsed = cli.build_parser().parse_args(expanded)  # SystemExit on a bad flag
                assert parsed.role == c["name"]
                for var in (e["name"] for e in c["env"] if e["name"].startswith("FERRY_")):
                    flag = "--" + var.removeprefix("FERRY_").lower().replace("_", "-")
                    assert hasattr(parsed, flag[2:].replace("-", "_")), var
    workers = [("prefill", spec.prefill + spec.prefill_dep - 1), ("decode", spec.decode)]
    workers += [("decode", spec.decode_dep - 1), ("aggregated", spec.aggregated)]
    assert roles >= {"scheduler", "gateway"} | {r for r, n in workers if n}
    if max(spec.prefill_dep, spec.decode_dep) > 1:
        assert "eplb" in roles


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_services_budgets_and_probes_reach_their_pods(shape: str, tmp_path: Path) -> None:
    objects = _render(tmp_path, SHAPES[shape])
    templates = [t for o in objects for t in _templates(o)]
    ports_of = [
        {p["name"]: p["containerPort"] for c in t["spec"]["containers"] for p in c["ports"]}
        for t in templates
    ]
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):  # a workload owns its template
            assert _matches(
                obj["spec"]["selector"]["matchLabels"], _templates(obj)[0]["metadata"]["labels"]
            )
        if obj["kind"] == "Service":
            hit = [
                p
                for t, p in zip(templates, ports_of, strict=True)
                if _matches(obj["spec"]["selector"], t["metadata"]["labels"])
            ]
            assert hit, f"Service {obj['metadata']['name']} selects no pod"
            for port in obj["spec"]["ports"]:
                assert all(port["targetPort"] in p for p in hit), (obj["metadata"]["name"], port)
        if obj["kind"] == "PodDisruptionBudget":
            selector = obj["spec"]["selector"]["matchLabels"]
            if "leaderworkerset.sigs.k8s.io/name" not in selector:  # the LWS controller's label
                assert any(_matches(selector, t["metadata"]["labels"]) for t in templates)
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    for t in templates:  # a pod under two budgets could never be evicted
        labels = t["metadata"]["labels"]
        mine = [b for b in budgets if _matches(b["spec"]["selector"]["matchLabels"], labels)]
        assert len(mine) <= 1, [b["metadata"]["name"] for b in mine]
    for t, ports in zip(templates, ports_of, strict=True):
        for c in t["spec"]["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe not in c:
                    continue
                check = next(
                    v for k, v in c[probe].items() if k in ("grpc", "httpGet", "tcpSocket", "exec")
                )
                if "port" in check:
                    assert check["port"] in ports.values(), (c["name"], probe)
    services = {
        f"{o['metadata']['name']}:{p['port']}"
        for o in objects
        if o["kind"] == "Service"
        for p in o["spec"]["ports"]
    }
    gateway = next(c for t in templates for c in t["spec"]["containers"] if c["name"] == "gateway")
    schedulers = gateway["args"][gateway["args"].index("--scheduler") + 1].split(",")
    assert schedulers and set(schedulers) <= services


def test_secrets_come_from_kubernetes_secrets(tmp_path: Path) -> None:
    objects = _render(tmp_path, SHAPES["gpus"])
    text = yaml.safe_dump_all(objects)
    gateway = next(
        c
        for o in objects
        for t in _templates(o)
        for c in t["spec"]["containers"]
        if c["name"] == "gateway"
    )
    key = next(e for e in gateway["env"] if e["name"] == "FERRY_API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "ferry-key", "key": "api-key"}
    assert "/etc/ferry/tls/tls.crt" in gateway["args"] and "secretName: ferry-tls" in text
    worker = next(
        c
        for o in objects
        for t in _templates(o)
        for c in t["spec"]["containers"]
        if c["name"] == "aggregated"
    )
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert worker["resources"]["limits"]["rdma/ib"] == "1"
    assert worker["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert worker["readinessProbe"].keys() >= {"tcpSocket"}  # kubelet's gRPC probe has no TLS


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--api-key", "sk-1"], "--api-key-secret"),
        (["--tls"], "--tls-secret"),
        (["--hosts", "3"], "pods have hosts of their own"),
        (["--model", "/data/ckpt"], "--model-pvc"),
        (["--model", "ckpt", "--model-pvc", "c"], "absolute path"),
        (["--aggregated", "1", "--disaggregated-set"], "two worker roles"),
        (["--node-selector", "gpu"], "KEY=VALUE"),
        (["--restart", "never"], "restarts pods itself"),
        (["--prefill-args=--no-such-flag"], "not flags of `ferry serve prefill`"),
    ],
)
def test_what_a_cluster_cannot_take_is_refused(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert cli.main(["deploy", "k8s", *argv, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # nothing half-written


def test_a_new_render_replaces_the_last(tmp_path: Path) -> None:
    out = tmp_path / "manifests"
    _render(tmp_path, ["--decode-dep", "2"])
    mine = out / "kustomization.yaml"
    mine.write_text("resources: []\n")  # not ours: kept
    assert cli.main(["deploy", "k8s", "--out", str(out)]) == 0
    ours = [f for f in out.glob("*.yaml") if f != mine]
    assert mine.exists() and all(f.read_text().startswith(HEADER) for f in ours)
    assert not [f for f in ours if "leaderworkerset" in f.name]
