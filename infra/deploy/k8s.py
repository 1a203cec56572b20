"""Kubernetes manifests for a ClusterSpec: what ``ferry up`` starts as processes, as objects.

One pod per ``ferry serve ROLE`` process, with the flags ``ferry up`` would give it:

- workers (prefill, decode, aggregated): a Deployment per role; a DEP group a LeaderWorkerSet of
  the group's size (rank = the pod's LWS worker index, master = the leader's address), restarted
  as one group as ``ferry up`` restarts it; with ``disaggregated_set`` the worker roles are the
  roles of one DisaggregatedSet (one LeaderWorkerSet each, size 1 for independent workers);
- each scheduler replica a Deployment and a Service (the gateway spreads requests over their
  addresses, as it does over ``ferry up``'s); the gateway a Deployment and a Service; the EPLB
  controller a Deployment when there is a DEP group; Redis a StatefulSet, unless a URL is given;
- gRPC probes (tcpSocket under TLS: kubelet's gRPC probe cannot speak it), HTTP ones for the
  gateway; a PodDisruptionBudget per workload; Prometheus scrape annotations on every pod and
  optionally a PodMonitor; secrets (the API key, TLS files) from Kubernetes Secrets, never in a
  manifest.

Workers register in Redis under a name other pods can dial: ``POD.SUBDOMAIN.NAMESPACE.svc``
through a headless Service, so one certificate for ``*.SUBDOMAIN.NAMESPACE.svc`` covers them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferry.infra.launcher import WORKER_ROLES, ClusterSpec

Obj = dict[str, Any]

# Every pod has an address of its own: fixed ports, the same in every pod of a role.
WORKER_PORT = 50060
KV_PORT = 50070
DEP_MASTER_PORT = 29500
EPLB_PORT = 50053
METRICS_PORT = 9100
REDIS_PORT = 6379
TLS_DIR = "/etc/ferry/tls"
HEADER = "# rendered by `ferry deploy k8s`; render again rather than edit\n"
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


@dataclass(frozen=True)
class K8sOptions:
    """What Kubernetes needs besides the cluster's shape (`ferry deploy k8s`'s own flags)."""

    namespace: str = "ferry"
    image: str = "ferry:dev"
    image_pull_policy: str = "IfNotPresent"
    redis_image: str = "redis:7.4-alpine"
    worker_cpus: int = 4  # each worker pod's; a prefill worker's torch threads by default
    worker_memory: str = "16Gi"
    shm_size: str = "2Gi"  # /dev/shm: UCX and torch's shared memory (64 MiB by default)
    gpus: int = 0  # per worker pod
    gpu_resource: str = "nvidia.com/gpu"
    rdma_resource: str = ""  # e.g. rdma/ib: one per worker pod, and IPC_LOCK for UCX's pinning
    host_network: bool = False  # workers on their node's network (UCX over the node's NICs)
    ucx_tls: str = ""  # the workers' UCX_TLS ("": UCX picks)
    node_selector: dict[str, str] = field(default_factory=dict)  # for the worker pods
    model_pvc: str = ""  # a claim holding --model's directory, mounted read-only at that path
    api_key_secret: str = ""  # a Secret whose "api-key" the gateway requires
    tls_secret: str = ""  # tls.crt, tls.key, ca.crt (as cert-manager writes them)
    gateway_replicas: int = 1
    gateway_service_type: str = "ClusterIP"
    disaggregated_set: bool = False
    pod_monitor: bool = False  # a Prometheus Operator PodMonitor as well as the annotations

    def __post_init__(self) -> None:
        if self.worker_cpus < 1:
            raise ValueError(f"--worker-cpus {self.worker_cpus}: at least 1")
        if self.gateway_replicas < 1:
            raise ValueError(f"--gateway-replicas {self.gateway_replicas}: at least 1")
        if self.gateway_service_type not in ("ClusterIP", "NodePort", "LoadBalancer"):
            raise ValueError(f"--gateway-service-type {self.gateway_service_type}: not a type")


class Renderer:
    def __init__(self, spec: ClusterSpec, opts: K8sOptions, model: str) -> None:
        self.spec, self.opts, self.model = spec, opts, model
        self.prefix = "ferry" if spec.cluster == "default" else f"ferry-{spec.cluster}"
        self.objects: list[Obj] = []
        self.redis_url = spec.redis_url or f"redis://{self.prefix}-redis:{REDIS_PORT}/0"
        self.workers_service = f"{self.prefix}-workers"

    # ---- the cluster ----
    def render(self) -> list[Obj]:
        s = self.spec
        if not s.redis_url:
            self._redis()
        self._workers_service()
        groups = self._worker_roles()
        if self.opts.disaggregated_set:
            self._disaggregated_set(groups)
        else:
            for role, count, dep in groups:
                if count:
                    self._worker_deployment(role, count)
                if dep > 1:
                    self._lws(role, dep)
        schedulers = []
        for i in range(s.schedulers):
            name = f"{self.prefix}-scheduler-{i}"
            port = s.scheduler_port or 50052
            schedulers.append(f"{name}:{port}")
            self._control("scheduler", name, port)
            self._service(name, "scheduler", {"grpc": port}, component_label=name)
        if max(s.prefill_dep, s.decode_dep) > 1:
            self._control("eplb", f"{self.prefix}-eplb", EPLB_PORT)
        if s.gateway:
            self._gateway(schedulers)
        if self.opts.pod_monitor:
            self._pod_monitor()
        return self.objects

    def _worker_roles(self) -> list[tuple[str, int, int]]:
        s = self.spec
        roles = [("prefill", s.prefill, s.prefill_dep), ("decode", s.decode, s.decode_dep)]
        roles.append(("aggregated", s.aggregated, 1))
        return [(r, n, d) for r, n, d in roles if n or d > 1]

    # ---- workers ----
    def _worker_pod(self, role: str, component: str, subdomain: str, dep: int = 1) -> Obj:
        """The pod template of a worker of ``role``; ``dep`` > 1: a rank of a LeaderWorkerSet.
        ``subdomain``: the headless Service its name resolves under ("": none known, it is
        dialled at its address)."""
        o = self.opts
        args = [*self._serve(role, WORKER_PORT), "--kv-port", str(KV_PORT)]
        env = _downward()
        if o.host_network or not subdomain:  # no name of its own: dial its address
            env.append(_env("FERRY_ADVERTISE_HOST", field_path="status.podIP"))
        else:
            env.append(
                _env("FERRY_ADVERTISE_HOST", f"$(POD_NAME).{subdomain}.$(POD_NAMESPACE).svc")
            )
        env.append(_env("FERRY_WORKER_ID", "$(POD_NAME)"))
        if dep > 1:
            env.append(_env("FERRY_DEP_RANK", field_path=f"metadata.labels['{LWS_INDEX_LABEL}']"))
            # LWS puts the leader's address in every rank's environment; $(...) is expanded
            args += [
                "--dep-size",
                str(dep),
                "--dep-master",
                f"$(LWS_LEADER_ADDRESS):{DEP_MASTER_PORT}",
            ]
        if o.ucx_tls:
            env.append(_env("UCX_TLS", o.ucx_tls))
        ports = {"grpc": WORKER_PORT, "kv": KV_PORT, "metrics": METRICS_PORT}
        if dep > 1:
            ports["dep"] = DEP_MASTER_PORT
        limits: dict[str, str] = {"memory": o.worker_memory}
        if o.gpus:
            limits[o.gpu_resource] = str(o.gpus)
        if o.rdma_resource:
            limits[o.rdma_resource] = "1"
        container = self._container(
            role,
            args,
            ports,
            env,
            resources={"requests": {"cpu": str(o.worker_cpus), **limits}, "limits": limits},
            probe_port=WORKER_PORT,
            startup_s=1800,  # a checkpoint's load: minutes on a real model
            ipc_lock=bool(o.rdma_resource),
        )
        container["volumeMounts"].append({"name": "shm", "mountPath": "/dev/shm"})
        pod = self._pod_spec([container], role)
        pod["volumes"].append(
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": o.shm_size}}
        )
        if o.node_selector:
            pod["nodeSelector"] = dict(o.node_selector)
        if o.host_network:
            pod["hostNetwork"] = True
            pod["dnsPolicy"] = "ClusterFirstWithHostNet"
        if dep == 1 and subdomain == self.workers_service:
            pod["subdomain"] = subdomain  # a LeaderWorkerSet sets its own
        return {"metadata": self._pod_meta(role, METRICS_PORT, component), "spec": pod}

    def _workers_service(self) -> None:
        """Headless, for the workers' names (a pod's name under it resolves to its address)."""
        svc = self._service(self.workers_service, "workers", {"grpc": WORKER_PORT})
        svc["spec"]["clusterIP"] = "None"
        svc["spec"]["publishNotReadyAddresses"] = True  # a worker registers before it is ready
        svc["spec"]["selector"] = {**self._selector(""), "ferry.dev/worker": "true"}

    def _worker_deployment(self, role: str, count: int) -> None:
        name = f"{self.prefix}-{role}"
        template = self._worker_pod(role, role, self.workers_service)
        self._workload("Deployment", name, role, count, template)

    def _lws_spec(self, role: str, dep: int, replicas: int, subdomain: str) -> Obj:
        component = f"{role}-dep" if dep > 1 else role
        return {
            "replicas": replicas,
            "leaderWorkerTemplate": {
                "size": dep,
                # a rank's death fails its peers: the group starts over, as `ferry up` does it
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": self._worker_pod(role, component, subdomain, dep),
            },
            "startupPolicy": "LeaderCreated",
        }

    def _lws(self, role: str, dep: int) -> None:
        name = f"{self.prefix}-{role}-dep"
        self._add(
            {
                "apiVersion": LWS_API,
                "kind": "LeaderWorkerSet",
                "metadata": self._meta(name, role),
                "spec": self._lws_spec(role, dep, 1, subdomain=name),
            }
        )
        self._pdb(name, {"leaderworkerset.sigs.k8s.io/name": name})

    def _disaggregated_set(self, groups: list[tuple[str, int, int]]) -> None:
        """The worker roles as the roles of one DisaggregatedSet: one LeaderWorkerSet each (a
        role's independent workers: groups of one; its DEP group: one group of its size)."""
        roles = []  # the controller names their LeaderWorkerSets: workers go by address
        for role, count, dep in groups:
            if count:
                roles.append({"name": role, "spec": self._lws_spec(role, 1, count, "")})
            if dep > 1:
                roles.append({"name": f"{role}-dep", "spec": self._lws_spec(role, dep, 1, "")})
        if len(roles) < 2:
            raise ValueError(
                "--disaggregated-set needs two worker roles at least (prefill and decode)"
            )
        name = f"{self.prefix}-workers"
        self._add(
            {
                "apiVersion": "disaggregatedset.x-k8s.io/v1",
                "kind": "DisaggregatedSet",
                "metadata": self._meta(name, "workers"),
                "spec": {"roles": roles},
            }
        )
        self._pdb(name, {**self._selector(""), "ferry.dev/worker": "true"})

    # ---- the control plane ----
    def _control(self, role: str, name: str, port: int) -> None:
        container = self._container(
            role,
            [*self._serve(role, port)],
            {"grpc": port, "metrics": METRICS_PORT},
            [*_downward(), _env("FERRY_WORKER_ID", "$(POD_NAME)")],
            resources=_small(),
            probe_port=port,
        )
        template = {
            "metadata": self._pod_meta(role, METRICS_PORT, name),
            "spec": self._pod_spec([container], role),
        }
        self._workload("Deployment", name, name, 1, template)

    def _gateway(self, schedulers: list[str]) -> None:
        s, o = self.spec, self.opts
        http, grpc = s.gateway_port or 8000, s.grpc_port or 50051
        args = ["serve", "gateway", "--host", "0.0.0.0", "--port", str(http)]
        args += ["--grpc-port", str(grpc), "--scheduler", ",".join(schedulers)]
        args += [*self._tls_flags(), *s.serve_args.get("gateway", [])]
        env = []
        if o.api_key_secret:  # the key reaches the gateway in its environment, from the Secret
            ref = {"name": o.api_key_secret, "key": "api-key"}
            env.append({"name": "FERRY_API_KEY", "valueFrom": {"secretKeyRef": ref}})
        container = self._container(
            "gateway",
            args,
            {"http": http, "grpc": grpc},
            env,
            resources=_small(),
            probe_port=http,
            http_probe=True,
        )
        name = f"{self.prefix}-gateway"
        template = {
            "metadata": self._pod_meta("gateway", http),
            "spec": self._pod_spec([container], "gateway"),
        }
        self._workload("Deployment", name, "gateway", o.gateway_replicas, template)
        svc = self._service(name, "gateway", {"http": http, "grpc": grpc})
        svc["spec"]["type"] = o.gateway_service_type

    def _redis(self) -> None:
        """Ferry's cluster state is soft (services re-register within a heartbeat): one Redis,
        no persistence, as ``ferry up``'s private redis-server."""
        name = f"{self.prefix}-redis"
        container = {
            "name": "redis",
            "image": self.opts.redis_image,
            "imagePullPolicy": self.opts.image_pull_policy,
            "args": ["--save", "", "--appendonly", "no", "--protected-mode", "no"],
            "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
            "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5},
            "livenessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 10},
            "resources": _small(),
            "securityContext": _restricted(user=999),
        }
        template = {
            "metadata": {"labels": self._selector("redis")},
            "spec": {"containers": [container], "securityContext": _pod_security(999)},
        }
        sts = self._workload("StatefulSet", name, "redis", 1, template)
        sts["spec"]["serviceName"] = name
        svc = self._service(name, "redis", {"redis": REDIS_PORT})
        svc["spec"]["clusterIP"] = "None"

    # ---- pieces ----
    def _serve(self, role: str, port: int) -> list[str]:
        """``ferry serve ROLE``'s argv: what ``ferry up`` gives the process, on a pod's ports."""
        s = self.spec
        return [
            "serve",
            role,
            *("--host", "0.0.0.0", "--port", str(port)),
            *("--metrics-port", str(METRICS_PORT)),
            *("--redis-url", self.redis_url, "--cluster", s.cluster),
            *self._tls_flags(),
            *s.serve_args.get(role, []),
        ]

    def _tls_flags(self) -> list[str]:
        if not self.opts.tls_secret:
            return []
        return [
            *("--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key"),
            *("--tls-ca", f"{TLS_DIR}/ca.crt"),
        ]

    def _container(
        self,
        role: str,
        args: list[str],
        ports: dict[str, int],
        env: list[Obj],
        resources: Obj,
        probe_port: int,
        startup_s: int = 120,
        http_probe: bool = False,
        ipc_lock: bool = False,
    ) -> Obj:
        o = self.opts
        if http_probe:
            scheme = "HTTPS" if o.tls_secret else "HTTP"
            check: Obj = {"httpGet": {"path": "/health", "port": probe_port, "scheme": scheme}}
        elif o.tls_secret:  # kubelet's gRPC probe speaks no TLS: the port must at least answer
            check = {"tcpSocket": {"port": probe_port}}
        else:
            check = {"grpc": {"port": probe_port}}
        mounts: list[Obj] = []
        if o.tls_secret:
            mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
        if o.model_pvc and role in (*WORKER_ROLES, "gateway"):
            mounts.append({"name": "model", "mountPath": self.model, "readOnly": True})
        return {
            "name": role,
            "image": o.image,
            "imagePullPolicy": o.image_pull_policy,
            "args": args,
            "env": env,
            "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
            "startupProbe": {**check, "periodSeconds": 5, "failureThreshold": startup_s // 5},
            "readinessProbe": {**check, "periodSeconds": 5},
            "livenessProbe": {**check, "periodSeconds": 10, "failureThreshold": 6},
            "resources": resources,
            "securityContext": _restricted(ipc_lock=ipc_lock),
            "volumeMounts": mounts,
        }

    def _pod_spec(self, containers: list[Obj], role: str) -> Obj:
        o = self.opts
        volumes: list[Obj] = []
        if o.tls_secret:
            volumes.append({"name": "tls", "secret": {"secretName": o.tls_secret}})
        if o.model_pvc and role in (*WORKER_ROLES, "gateway"):
            claim = {"claimName": o.model_pvc, "readOnly": True}
            volumes.append({"name": "model", "persistentVolumeClaim": claim})
        return {
            "containers": containers,
            "volumes": volumes,
            "securityContext": _pod_security(10001),  # the image's user
            "terminationGracePeriodSeconds": 30,  # SIGTERM: in-flight requests finish
        }

    def _pod_meta(self, role: str, metrics_port: int, component: str = "") -> Obj:
        labels = self._selector(component or role)
        if role in WORKER_ROLES:
            labels["ferry.dev/worker"] = "true"
            labels["ferry.dev/role"] = role
        annotations = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(metrics_port),
            "prometheus.io/path": "/metrics",
        }
        if role == "gateway" and self.opts.tls_secret:
            annotations["prometheus.io/scheme"] = "https"
        return {"labels": labels, "annotations": annotations}

    def _workload(self, kind: str, name: str, component: str, replicas: int, template: Obj) -> Obj:
        obj = {
            "apiVersion": "apps/v1",
            "kind": kind,
            "metadata": self._meta(name, component),
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": self._selector(component)},
                "template": template,
            },
        }
        self._add(obj)
        self._pdb(name, self._selector(component))
        return obj

    def _pdb(self, name: str, selector: dict[str, str]) -> None:
        """One pod of a workload evicted at a time (for a DEP group: its whole group)."""
        self._add(
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": self._meta(name, name),
                "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
            }
        )

    def _service(
        self, name: str, component: str, ports: dict[str, int], component_label: str = ""
    ) -> Obj:
        svc = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self._meta(name, component),
            "spec": {
                "selector": self._selector(component_label or component),
                "ports": [
                    {"name": n, "port": p, "targetPort": n, "protocol": "TCP"}
                    for n, p in ports.items()
                ],
            },
        }
        self._add(svc)
        return svc

    def _pod_monitor(self) -> None:
        self._add(
            {
                "apiVersion": "monitoring.coreos.com/v1",
                "kind": "PodMonitor",
                "metadata": self._meta(self.prefix, "metrics"),
                "spec": {
                    "selector": {"matchLabels": self._selector("")},
                    "podMetricsEndpoints": [
                        {"port": "metrics", "path": "/metrics"},
                        {"port": "http", "path": "/metrics"},  # the gateway's
                    ],
                },
            }
        )

    def _meta(self, name: str, component: str) -> Obj:
        return {"name": name, "namespace": self.opts.namespace, "labels": self._selector(component)}

    def _selector(self, component: str) -> dict[str, str]:
        labels = {"app.kubernetes.io/name": "ferry", "app.kubernetes.io/instance": self.prefix}
        if component:
            labels["app.kubernetes.io/component"] = component
        return labels

    def _add(self, obj: Obj) -> None:
        self.objects.append(obj)


def _env(name: str, value: str = "", field_path: str = "") -> Obj:
    if field_path:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}
    return {"name": name, "value": value}


def _downward() -> list[Obj]:
    """The pod's own name and namespace, for the variables after them to use as $(POD_NAME)."""
    return [
        _env("POD_NAME", field_path="metadata.name"),
        _env("POD_NAMESPACE", field_path="metadata.namespace"),
    ]


def _small() -> Obj:
    return {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}


def _restricted(user: int = 10001, ipc_lock: bool = False) -> Obj:
    """Pod Security's "restricted" profile; IPC_LOCK for RDMA (UCX pins its buffers)."""
    caps: Obj = {"drop": ["ALL"]}
    if ipc_lock:
        caps["add"] = ["IPC_LOCK"]
    return {
        "allowPrivilegeEscalation": False,
        "runAsNonRoot": True,
        "runAsUser": user,
        "capabilities": caps,
    }


def _pod_security(user: int) -> Obj:
    return {"runAsNonRoot": True, "runAsUser": user, "seccompProfile": {"type": "RuntimeDefault"}}


def write(objects: list[Obj], out: Path, command: str) -> list[Path]:
    """One file per object, ``NN-kind-name.yaml``, each one YAML document; files an earlier
    render wrote there (they start with ``HEADER``) are removed first."""
    import yaml

    class Plain(yaml.SafeDumper):  # no &anchors / *aliases for repeated values: plain YAML
        def ignore_aliases(self, data: Any) -> bool:
            return True

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.yaml"):
        if old.read_text().startswith(HEADER):
            old.unlink()
    paths = []
    for i, obj in enumerate(objects):
        path = out / f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        text = yaml.dump(obj, Dumper=Plain, sort_keys=False, default_flow_style=False)
        path.write_text(f"{HEADER}# {command}\n---\n{text}")
        paths.append(path)
    return paths
