"""The Kubernetes manifests under deploy/k8s, rendered and validated offline (no cluster, no kubectl).

- Rendering: a small kustomize in this file (resources, configMapGenerator with kustomize's
  content-hash names and their references, generatorOptions, images, strategic-merge and JSON 6902
  patches). A kustomization using anything else fails the render instead of rendering wrong.
  Where `kubectl` is installed its built-in kustomize renders the same directories and the two
  outputs must be equal; elsewhere that comparison is skipped.
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
import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
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

NS = "genrec"
TRITON = "genrec-triton"
BALANCER = "genrec-balancer"
REDIS = "genrec-redis"


# ================================================================================================
# A small kustomize
# ================================================================================================
class RenderError(Exception):
    pass


class StrictLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys silently; a manifest with one is refused here."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        dupes = {k for k in keys if keys.count(k) > 1}
        if dupes:
            raise RenderError(f"duplicate keys {sorted(map(str, dupes))} {node.start_mark}")
        return super().construct_mapping(node, deep=deep)


def load_all(text: str) -> list:
    return [o for o in yaml.load_all(text, Loader=StrictLoader) if o is not None]


KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "configMapGenerator", "generatorOptions", "images", "patches"}
GENERATOR_FIELDS = {"name", "namespace", "files", "literals", "options"}
GENERATOR_OPTIONS = {"labels", "annotations", "disableNameSuffixHash"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def render(directory: Path) -> list:
    """The objects `kustomize build directory` would print (in resource order)."""
    directory = Path(directory).resolve()
    kfile = directory / "kustomization.yaml"
    if not kfile.is_file():
        raise RenderError(f"no kustomization.yaml in {directory}")
    k = yaml.load(kfile.read_text(), Loader=StrictLoader) or {}
    unknown = set(k) - KUSTOMIZATION_FIELDS
    if unknown:
        raise RenderError(f"{kfile}: fields this renderer does not implement: {sorted(unknown)}")
    objs = []
    for entry in k.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objs += render(path)
        elif path.is_file():
            objs += load_all(path.read_text())
        else:
            raise RenderError(f"{kfile}: resource {entry} not found")
    renamed = {}
    for gen in k.get("configMapGenerator", []):
        cm = _generate_configmap(directory, gen, k.get("generatorOptions") or {})
        if cm["metadata"]["name"] != gen["name"]:
            renamed[(cm["metadata"].get("namespace"), gen["name"])] = cm["metadata"]["name"]
        objs.append(cm)
    for patch in k.get("patches", []):
        objs = _apply_patch(directory, objs, patch)
    _set_images(objs, k.get("images", []))
    _rename_configmap_references(objs, renamed)
    seen = set()
    for o in objs:
        key = _key(o)
        if key in seen:
            raise RenderError(f"{kfile}: {key} defined twice")
        seen.add(key)
    return objs


def _key(o: dict) -> tuple:
    return (o.get("apiVersion"), o.get("kind"), o["metadata"].get("namespace"), o["metadata"].get("name"))


def configmap_hash(cm: dict) -> str:
    """kustomize's name suffix of a generated ConfigMap (api/hasher): sha256 of the Go JSON encoding
    of {"data", "kind", "name"}, 10 hex digits with 0 1 3 a e swapped for g h k m t. kustomize 5
    looks the name up under a path it does not find, so "name" is always "" there: copied as is
    (the comparison with kubectl's kustomize below checks the result)."""
    m = {"kind": "ConfigMap", "name": "", "data": cm.get("data") or {}}
    if cm.get("binaryData"):
        m["binaryData"] = cm["binaryData"]
    text = json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return hashlib.sha256(text.encode()).hexdigest()[:10].translate(str.maketrans("013ae", "ghkmt"))


def _generate_configmap(directory: Path, gen: dict, global_options: dict) -> dict:
    unknown = set(gen) - GENERATOR_FIELDS
    options = {**global_options}
    for name, value in (gen.get("options") or {}).items():
        options[name] = {**options.get(name, {}), **value} if isinstance(value, dict) else value
    unknown |= set(options) - GENERATOR_OPTIONS
    if unknown:
        raise RenderError(f"configMapGenerator {gen.get('name')}: unsupported {sorted(unknown)}")
    data = {}
    for entry in gen.get("files", []):
        key, _, path = entry.rpartition("=") if "=" in entry else (Path(entry).name, "", entry)
        data[key] = (directory / path).read_text()
    for entry in gen.get("literals", []):
        key, _, value = entry.partition("=")
        data[key] = value
    metadata = {"name": gen["name"]}
    if gen.get("namespace"):
        metadata["namespace"] = gen["namespace"]
    if options.get("labels"):
        metadata["labels"] = dict(options["labels"])
    if options.get("annotations"):
        metadata["annotations"] = dict(options["annotations"])
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}
    if not options.get("disableNameSuffixHash"):
        metadata["name"] = f"{gen['name']}-{configmap_hash(cm)}"
    return cm


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


def _rename_configmap_references(objs: list, renamed: dict) -> None:
    for o in objs:
        spec = pod_spec(o)
        if spec is None:
            continue
        ns = o["metadata"].get("namespace")

        def fix(ref: dict, field: str = "name") -> None:
            if ref is not None and (ns, ref.get(field)) in renamed:
                ref[field] = renamed[(ns, ref[field])]

        for vol in spec.get("volumes", []):
            fix(vol.get("configMap"))
            for src in (vol.get("projected") or {}).get("sources", []):
                fix(src.get("configMap"))
        for c in containers(spec):
            for env in c.get("env", []):
                fix((env.get("valueFrom") or {}).get("configMapKeyRef"))
            for src in c.get("envFrom", []):
                fix(src.get("configMapRef"))


def _set_images(objs: list, images: list) -> None:
    for entry in images:
        if set(entry) - {"name", "newName", "newTag", "digest"}:
            raise RenderError(f"images: unsupported {entry}")
        for o in objs:
            spec = pod_spec(o)
            for c in containers(spec) if spec else []:
                name, tag = split_image(c["image"])
                if name != entry["name"]:
                    continue
                name = entry.get("newName", name)
                if "digest" in entry:
                    c["image"] = f"{name}@{entry['digest']}"
                else:
                    tag = entry.get("newTag", tag)
                    c["image"] = f"{name}:{tag}" if tag else name


def split_image(image: str) -> tuple:
    """("registry/name", "tag") of an image reference (digest references: tag None)."""
    if "@" in image:
        return image.split("@", 1)[0], None
    head, _, last = image.rpartition("/")
    if ":" in last:
        last, tag = last.split(":", 1)
        return (f"{head}/{last}" if head else last), tag
    return image, None


def _apply_patch(directory: Path, objs: list, patch: dict) -> list:
    if set(patch) - {"path", "patch", "target"}:
        raise RenderError(f"patches: unsupported {patch}")
    text = (directory / patch["path"]).read_text() if "path" in patch else patch["patch"]
    body = yaml.load(text, Loader=StrictLoader)
    target = patch.get("target")
    if isinstance(body, list):  # JSON 6902
        if not target:
            raise RenderError("a JSON 6902 patch needs a target")
        hits = [i for i, o in enumerate(objs) if _matches_target(o, target)]
        if not hits:
            raise RenderError(f"patch target {target} matches nothing")
        for i in hits:
            objs[i] = json_patch(objs[i], body)
        return objs
    # strategic merge: its own kind/name select the object unless a target is given
    target = target or {"kind": body["kind"], "name": body["metadata"]["name"],
                        **({"namespace": body["metadata"]["namespace"]} if body["metadata"].get("namespace") else {})}
    hits = [i for i, o in enumerate(objs) if _matches_target(o, target)]
    if not hits:
        raise RenderError(f"patch {patch.get('path', '<inline>')} matches nothing")
    if body.get("$patch") == "delete":
        return [o for i, o in enumerate(objs) if i not in hits]
    for i in hits:
        patched = strategic_merge(objs[i], {k: v for k, v in body.items() if k not in ("apiVersion", "kind", "metadata")})
        patched["metadata"] = strategic_merge(objs[i]["metadata"], {k: v for k, v in body["metadata"].items()
                                                                   if k not in ("name", "namespace")})
        objs[i] = patched
    return objs


def _matches_target(o: dict, target: dict) -> bool:
    if set(target) - {"group", "version", "kind", "name", "namespace"}:
        raise RenderError(f"patch target: unsupported {target}")
    group, _, version = o["apiVersion"].rpartition("/")
    return (
        target.get("kind", o["kind"]) == o["kind"]
        and target.get("name", o["metadata"]["name"]) == o["metadata"]["name"]
        and target.get("namespace", o["metadata"].get("namespace")) == o["metadata"].get("namespace")
        and target.get("group", group) == group
        and target.get("version", version) == version
    )


# Merge keys of the lists the patches here touch (Kubernetes' patchMergeKey); other lists are
# replaced, as the API's strategic merge does for lists without one.
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name", "env": "name",
    "volumes": "name", "volumeMounts": "mountPath", "imagePullSecrets": "name", "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
}


def strategic_merge(base, patch):
    if not isinstance(patch, dict) or not isinstance(base, dict):
        return copy.deepcopy(patch)
    for directive in patch:
        if directive.startswith("$") and directive != "$patch":
            raise RenderError(f"strategic merge directive {directive} not implemented")
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    out = copy.deepcopy(base)
    for k, v in patch.items():
        if k == "$patch":
            raise RenderError(f"$patch: {v} inside a map is not implemented")
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict):
            out[k] = strategic_merge(out.get(k, {}), v)
        elif isinstance(v, list) and k in MERGE_KEYS and isinstance(out.get(k), list):
            out[k] = _merge_list(out[k], v, MERGE_KEYS[k])
        elif isinstance(v, list) and k == "ports" and isinstance(out.get(k), list):
            key = "containerPort" if any("containerPort" in p for p in v + out[k]) else "port"
            out[k] = _merge_list(out[k], v, key)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _merge_list(base: list, patch: list, key: str) -> list:
    """Items matched by `key` are merged in place; new ones come first, in the patch's order
    (where kustomize puts them)."""
    out, added = copy.deepcopy(base), []
    for item in patch:
        index = next((i for i, b in enumerate(out) if b.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del out[index]
        elif index is None:
            added.append(copy.deepcopy(item))
        else:
            out[index] = strategic_merge(out[index], item)
    return added + out


def json_patch(doc: dict, ops: list) -> dict:
    """RFC 6902 add / remove / replace / test."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        if op["op"] == "add":
            if isinstance(parent, list):
                parent.insert(len(parent) if last == "-" else int(last), copy.deepcopy(op["value"]))
            else:
                parent[last] = copy.deepcopy(op["value"])
        elif op["op"] == "replace":
            if isinstance(parent, list):
                parent[int(last)] = copy.deepcopy(op["value"])
            elif last not in parent:
                raise RenderError(f"replace: {op['path']} does not exist")
            else:
                parent[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del parent[int(last) if isinstance(parent, list) else last]
        elif op["op"] == "test":
            value = parent[int(last)] if isinstance(parent, list) else parent[last]
            if value != op["value"]:
                raise RenderError(f"test failed at {op['path']}")
        else:
            raise RenderError(f"JSON patch op {op['op']} not implemented")
    return doc


# ================================================================================================
# Helpers over rendered objects
# ================================================================================================
@pytest.fixture(scope="module")
def rendered() -> dict:
    return {name: render(path) for name, path in OVERLAYS.items()}


def find(objs: list, kind: str, name: str, namespace: str = NS) -> dict:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name
            and o["metadata"].get("namespace") == namespace]
    assert len(hits) == 1, f"{kind} {namespace}/{name}: {len(hits)} found"
    return hits[0]


def find_prefix(objs: list, kind: str, prefix: str, namespace: str = NS) -> dict:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].startswith(prefix)
            and o["metadata"].get("namespace") == namespace]
    assert len(hits) == 1, f"{kind} {namespace}/{prefix}*: {len(hits)} found"
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
# Rendering
# ================================================================================================
def test_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(RenderError, match="namePrefix"):
        render(tmp_path)
    with pytest.raises(RenderError, match="retainKeys"):
        strategic_merge({"a": 1}, {"$retainKeys": ["a"]})
    with pytest.raises(RenderError, match="duplicate keys"):
        load_all("a: 1\nb: 2\na: 3\n")


def test_every_file_under_k8s_is_used():
    """Each manifest or config file is a resource, patch or generator input of a kustomization,
    or one of the standalone files (the publish Job, the CRD schema)."""
    used = {PUBLISH_JOB.resolve(), *(p.resolve() for p in CRD_SCHEMAS.values())}
    for kfile in K8S.rglob("kustomization.yaml"):
        used.add(kfile.resolve())
        k = yaml.safe_load(kfile.read_text())
        used |= {(kfile.parent / r).resolve() for r in k.get("resources", [])}
        used |= {(kfile.parent / p["path"]).resolve() for p in k.get("patches", []) if "path" in p}
        for gen in k.get("configMapGenerator", []):
            used |= {(kfile.parent / f.rpartition("=")[2]).resolve() for f in gen.get("files", [])}
    files = {p.resolve() for p in K8S.rglob("*") if p.is_file()}
    assert files - used == set()


def test_strategic_merge_and_json_patch_semantics():
    base = {"spec": {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}], "resources": {"limits": {"cpu": "1"}}},
                                    {"name": "b"}]}}
    out = strategic_merge(base, {"spec": {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}],
                                                          "resources": {"limits": {"gpu": 1}}}]}})
    a = out["spec"]["containers"][0]
    assert [e["name"] for e in a["env"]] == ["Y", "X"] and a["resources"]["limits"] == {"cpu": "1", "gpu": 1}
    assert out["spec"]["containers"][1] == {"name": "b"}
    patched = json_patch({"l": [1], "m": {"a/b": 1}}, [{"op": "add", "path": "/l/-", "value": 2},
                                                      {"op": "replace", "path": "/m/a~1b", "value": 3}])
    assert patched == {"l": [1, 2], "m": {"a/b": 3}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renders_as_kubectl_kustomize_does(overlay, rendered):
    """Only where kubectl is installed: its built-in kustomize must print the same objects."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl not installed: the renderer here is not compared with kustomize")
    proc = subprocess.run([kubectl, "kustomize", str(OVERLAYS[overlay])], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    theirs = sorted(json.dumps(o, sort_keys=True) for o in yaml.safe_load_all(proc.stdout) if o)
    ours = sorted(json.dumps(o, sort_keys=True) for o in rendered[overlay])
    assert ours == theirs


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
