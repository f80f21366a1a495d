"""Publish a checkpoint as the next version of every served model, roll back, list versions.

    python -m export.publish publish --checkpoint ckpt.pt --repository model_repository [--server localhost:8001]
    python -m export.publish rollback --repository model_repository [--server localhost:8001]
    (reloading needs the server's admin key: GENREC_ADMIN_KEY, or --admin-key-file, default runs/admin.key)
    python -m export.publish list --repository model_repository
    python -m export.publish verify --repository model_repository   (every version against its manifest)

publish: each Python model's next version directory is built in a staging folder on the
repository's filesystem and moved into ``<repository>/<model>/<version>/`` with one
``os.rename``, so a server never sees half a version. A version holds everything it runs, and no
absolute path, so a rollback serves the old code with the old weights and a repository can be
copied elsewhere and served:

    model.py           the stage's Triton model
    backend_src/       the package at this version (its .py files); model.py imports this copy
    genrec_contract/   the tensor contract at this version
    <stage>.pt         this stage's part of the checkpoint (encoder.pt, decoder.pt, ranker.pt)
    ranker.onnx        the ranker's export (and ranker.plan where TensorRT built one)
    manifest.json      package version and hash, checkpoint hash, serving options, every file's hash

Then every config.pbtxt is rewritten (atomically) and, given a server, each model is reloaded:
the server loads the new version while the old one keeps serving, then drops the old one
(version_policy latest 1).

rollback: moves the newest version of each model to ``<repository>/<model>/.retired/`` and
reloads, so the previous version serves again. Version numbers only grow: a publish after a
rollback takes a number above the retired ones.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from genrec_contract import protocol as P
from export.triton_configs import ServingOptions, add_serving_arguments, serving_options_from_args, write_configs

RETIRED = ".retired"
ENSEMBLE_VERSION = 1  # the ensemble has no weights: one version that always follows the latest steps
PROJECT_ROOT = Path(__file__).resolve().parents[1]  # holds the package and model_repository/<model>/model.py
PACKAGE = "backend_src"
PACKAGES = (PACKAGE, "genrec_contract")  # what a version carries of the code
MANIFEST = "manifest.json"
STAGES = {P.ENCODER: "encoder", P.DECODER: "decoder", P.RANKER: "ranker", P.CATALOG: "catalog"}  # keys of recommender.STAGE_PARTS
SERVER_HELP = "gRPC address of a running server to reload, e.g. localhost:8001 (several: comma-separated)"
ADMIN_KEY_HELP = "file with the server's admin key (default: GENREC_ADMIN_KEY, else runs/admin.key)"


def versions(model_dir: Path) -> list:
    """Numeric version directories of a model, ascending."""
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def retired_versions(model_dir: Path) -> list:
    return versions(model_dir / RETIRED)


def next_version(model_dir: Path) -> int:
    return max(versions(model_dir) + retired_versions(model_dir) + [0]) + 1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(
    checkpoint,
    repository,
    options: ServingOptions | None = None,
    server: str | None = None,
    ranker_onnx=None,
    ranker_plan=None,
    package_root: Path = PROJECT_ROOT,
    export_ranker: bool = True,
    admin_key: str | None = None,
) -> dict:
    """Add the next version of every Python model; returns {model: version}.

    Each version gets `package_root`'s backend_src and model_repository/<model>/model.py (the
    code it will run) and its stage's part of the checkpoint, which is loaded once. Unless
    given ready-made files (or export_ranker is False), the ranker is exported to ONNX, and
    built into a TensorRT plan where TensorRT is importable."""
    from backend_src.model.recommender import GenerativeRecommender

    checkpoint, repository, package_root = Path(checkpoint), Path(repository), Path(package_root)
    if server:
        check_server_access(server, admin_key)  # before anything changes
    sources = {m: package_root / "model_repository" / m / "model.py" for m in P.PYTHON_MODELS}
    missing = [str(p) for p in [*(package_root / pkg / "__init__.py" for pkg in PACKAGES), *sources.values()] if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{package_root} is not a package root: missing {', '.join(missing)}")
    recommender = GenerativeRecommender.load(checkpoint)
    cfg = recommender.cfg
    options = options or ServingOptions()
    repository.mkdir(parents=True, exist_ok=True)
    meta = {
        "package": package_info(package_root),
        "checkpoint": {"file": checkpoint.name, "sha256": _sha256(checkpoint)},  # a name, never a path
        "published_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "serving_options": options.to_dict(),
    }
    staging = Path(tempfile.mkdtemp(dir=repository.resolve().parent, prefix=f".{repository.name}-staging-"))
    done = {}
    try:
        # 1. build every version directory off to the side
        for model in P.PYTHON_MODELS:
            v = next_version(repository / model)
            vdir = staging / model / str(v)
            vdir.mkdir(parents=True)
            shutil.copy2(sources[model], vdir / "model.py")
            for pkg in PACKAGES:
                copy_package(package_root / pkg, vdir / pkg)
            recommender.save_stage(vdir / f"{STAGES[model]}.pt", STAGES[model])
            exported = {}
            if model == P.RANKER:
                if ranker_onnx:
                    shutil.copy2(ranker_onnx, vdir / "ranker.onnx")
                    exported["ranker.onnx"] = "given"
                elif export_ranker:
                    exported.update(_export_ranker(recommender, vdir))
                if ranker_plan:
                    shutil.copy2(ranker_plan, vdir / "ranker.plan")
                    exported["ranker.plan"] = "given"
            write_manifest(vdir, {**meta, "model": model, "version": v, "stage": STAGES[model], "exported": exported})
            done[model] = v
        # 2. configs first (new tensor dims must be there when the new version loads), then
        #    one rename per model; the server only looks at them on load_model
        write_configs(repository, cfg, options)
        for model, v in done.items():
            (repository / model).mkdir(exist_ok=True)
            os.rename(staging / model / str(v), repository / model / str(v))
            _fsync_dir(repository / model)
        (repository / P.ENSEMBLE / str(ENSEMBLE_VERSION)).mkdir(parents=True, exist_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if server:
        reload_models(server, done, admin_key=admin_key)
    return done


def current_options(repository) -> ServingOptions | None:
    """The serving options the newest version of the repository was published with (None if
    there is none), so a new version can keep them."""
    import dataclasses

    from backend_src.config import DecodeOptions

    model_dir = Path(repository) / P.ENCODER
    vs = versions(model_dir)
    if not vs:
        return None
    vdir = model_dir / str(vs[-1])
    saved_file = vdir / MANIFEST if (vdir / MANIFEST).exists() else vdir / "publish.json"  # older versions
    saved = json.loads(saved_file.read_text())["serving_options"]
    known = {f.name for f in dataclasses.fields(ServingOptions)}
    opts = {k: v for k, v in saved.items() if k in known}
    opts["decode"] = DecodeOptions(**opts["decode"])
    return ServingOptions(**opts)


def _export_ranker(model, vdir: Path) -> dict:
    """ranker.onnx (always) and ranker.plan (where TensorRT can build one) for this version."""
    from export.onnx_ranker import export_ranker_onnx
    from export.tensorrt_ranker import build_tensorrt_plan, default_profiles, tensorrt_available

    export_ranker_onnx(model, vdir / "ranker.onnx")
    if not tensorrt_available()[0]:
        return {"ranker.onnx": "exported"}
    build_tensorrt_plan(vdir / "ranker.onnx", vdir / "ranker.plan", default_profiles(model.cfg))
    return {"ranker.onnx": "exported", "ranker.plan": "exported"}


# --------------------------------------------------------------------------------------------
# What a version carries: its package and a manifest
# --------------------------------------------------------------------------------------------
def _package_files(package_dir: Path) -> list:
    """The package's .py files, relative to it, sorted (no bytecode, no caches)."""
    return sorted(p.relative_to(package_dir) for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts)


def copy_package(package_dir: Path, dest: Path) -> None:
    for rel in _package_files(package_dir):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(package_dir / rel, dest / rel)


def package_info(package_root: Path) -> dict:
    """Name, __version__ and a hash of every .py file of the packages under `package_root`."""
    package_dir = Path(package_root) / PACKAGE
    found = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', (package_dir / "__init__.py").read_text(), re.M)
    h = hashlib.sha256()
    for pkg in PACKAGES:
        for rel in _package_files(Path(package_root) / pkg):
            h.update(f"{pkg}/{rel.as_posix()}".encode() + b"\0" + _sha256(Path(package_root) / pkg / rel).encode() + b"\0")
    return {"name": PACKAGE, "version": found.group(1) if found else None, "sha256": h.hexdigest()}


def _version_files(vdir: Path) -> dict:
    """Relative path -> sha256 of every file of a version directory but the manifest (bytecode
    and kernel caches written while serving are not part of it)."""
    return {
        p.relative_to(vdir).as_posix(): _sha256(p)
        for p in sorted(vdir.rglob("*"))
        if p.is_file() and p.name != MANIFEST and "__pycache__" not in p.relative_to(vdir).parts
    }


def write_manifest(vdir: Path, manifest: dict) -> None:
    manifest = {**manifest, "files": _version_files(vdir)}
    (vdir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(vdir) -> dict:
    return json.loads((Path(vdir) / MANIFEST).read_text())


def verify_version(vdir) -> list:
    """What differs between a version directory and its manifest (empty: nothing)."""
    vdir = Path(vdir)
    if not (vdir / MANIFEST).is_file():
        return [f"{vdir.name}: no {MANIFEST}"]
    want, have = read_manifest(vdir)["files"], _version_files(vdir)
    problems = [f"missing {f}" for f in sorted(set(want) - set(have))]
    problems += [f"changed {f}" for f in sorted(set(want) & set(have)) if want[f] != have[f]]
    problems += [f"not in the manifest: {f}" for f in sorted(set(have) - set(want))]
    return problems


def verify(repository) -> dict:
    """{"<model>/<version>": problems} for every served version of the repository."""
    repository = Path(repository)
    return {f"{m}/{v}": verify_version(repository / m / str(v)) for m in P.PYTHON_MODELS for v in versions(repository / m)}


def rollback(repository, server: str | None = None, admin_key: str | None = None) -> dict:
    """Retire the newest version of every Python model; returns {model: (retired, now serving)}."""
    repository = Path(repository)
    if server:
        check_server_access(server, admin_key)  # before anything moves
    plan = {}
    for model in P.PYTHON_MODELS:
        vs = versions(repository / model)
        if len(vs) < 2:
            raise RuntimeError(f"{model}: nothing to roll back to (versions {vs})")
        plan[model] = (vs[-1], vs[-2])
    for model, (v, _) in plan.items():
        dest = repository / model / RETIRED
        dest.mkdir(exist_ok=True)
        target = dest / str(v)
        if target.exists():  # a version number is never reused, but be safe
            shutil.rmtree(target)
        os.rename(repository / model / str(v), target)
    if server:
        reload_models(server, {m: new for m, (_, new) in plan.items()}, admin_key=admin_key)
    return plan


def _servers(server) -> list:
    return [server] if isinstance(server, str) else list(server)


def _admin_headers(admin_key: str | None):
    from backend_src.serving.access import admin_headers, read_admin_key

    return admin_headers(admin_key or read_admin_key())


def check_server_access(server, admin_key: str | None = None) -> None:
    """Raise (InferenceServerException) unless every server accepts model control with this
    key: a repository index request needs the same key as load_model."""
    import tritonclient.grpc as grpcclient

    headers = _admin_headers(admin_key)
    for url in _servers(server):
        client = grpcclient.InferenceServerClient(url)
        try:
            client.get_model_repository_index(headers=headers, client_timeout=30)
        finally:
            client.close()


def reload_models(
    server, expected: dict | None = None, timeout_s: float = 300.0, admin_key: str | None = None
) -> None:
    """Reload through the ensemble: one load_model of the ensemble reloads every stage whose
    repository changed, in parallel, and the server swaps versions while serving. A stage not
    at its `expected` version afterwards is loaded on its own. `server`: a gRPC address, or a
    list of them (replicas of one repository, reloaded one after another). `admin_key`: the
    servers' key for model loading (None: GENREC_ADMIN_KEY, else runs/admin.key if there is one)."""
    import tritonclient.grpc as grpcclient

    headers = _admin_headers(admin_key)
    for url in _servers(server):
        client = grpcclient.InferenceServerClient(url)
        try:
            client.load_model(P.ENSEMBLE, headers=headers, client_timeout=timeout_s)
            for model in P.PYTHON_MODELS:
                want = [str(expected[model])] if expected else None
                if want and client.get_model_metadata(model).versions != want:
                    client.load_model(model, headers=headers, client_timeout=timeout_s)
                if not client.is_model_ready(model) or (want and client.get_model_metadata(model).versions != want):
                    raise RuntimeError(f"{url}: {model}: version {want} is not serving after load_model")
            if not client.is_model_ready(P.ENSEMBLE):
                raise RuntimeError(f"{url}: {P.ENSEMBLE} is not ready after load_model")
        finally:
            client.close()


def describe(repository) -> dict:
    repository = Path(repository)
    out = {}
    for model in P.ALL_MODELS:
        d = repository / model
        out[model] = {"versions": versions(d), "retired": retired_versions(d)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m export.publish", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="action", required=True)
    p = sub.add_parser("publish", help="add the next version of every model")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--repository", default="model_repository")
    p.add_argument("--server", default=None, help=SERVER_HELP)
    p.add_argument("--ranker-onnx", default=None, help="ONNX export of the ranker, placed in the ranker's version")
    p.add_argument("--ranker-plan", default=None, help="TensorRT plan of the ranker, placed in the ranker's version")
    p.add_argument("--no-ranker-export", action="store_true", help="serve the ranker in torch (no ONNX/TensorRT export)")
    p.add_argument("--admin-key-file", default=None, help=ADMIN_KEY_HELP)
    p.add_argument("--package-root", default=str(PROJECT_ROOT),
                   help="folder holding the backend_src and model_repository to publish (default: this checkout)")
    add_serving_arguments(p)
    r = sub.add_parser("rollback", help="retire the newest version of every model")
    r.add_argument("--repository", default="model_repository")
    r.add_argument("--server", default=None, help=SERVER_HELP)
    r.add_argument("--admin-key-file", default=None, help=ADMIN_KEY_HELP)
    ls = sub.add_parser("list", help="show versions")
    ls.add_argument("--repository", default="model_repository")
    vf = sub.add_parser("verify", help="check every version directory against its manifest")
    vf.add_argument("--repository", default="model_repository")
    a = ap.parse_args(argv)
    if getattr(a, "server", None) and "," in a.server:
        a.server = [u.strip() for u in a.server.split(",") if u.strip()]
    admin_key = None
    if a.action in ("publish", "rollback") and a.server:
        from backend_src.serving.access import read_admin_key

        admin_key = read_admin_key(a.admin_key_file)
        if a.admin_key_file and admin_key is None:
            print(f"no admin key in {a.admin_key_file}", file=sys.stderr)
            return 1

    from tritonclient.utils import InferenceServerException

    if a.action == "publish":
        try:
            done = publish(a.checkpoint, a.repository, serving_options_from_args(a), a.server, a.ranker_onnx,
                           a.ranker_plan, package_root=Path(a.package_root), export_ranker=not a.no_ranker_export,
                           admin_key=admin_key)
        except InferenceServerException as e:
            print(f"{a.server}: {e.message()}", file=sys.stderr)
            return 1
        print("published " + ", ".join(f"{m} v{v}" for m, v in done.items()) + (f"; reloaded on {a.server}" if a.server else ""))
    elif a.action == "rollback":
        try:
            plan = rollback(a.repository, a.server, admin_key=admin_key)
        except RuntimeError as e:
            print(str(e), file=sys.stderr)
            return 1
        except InferenceServerException as e:
            print(f"{a.server}: {e.message()}", file=sys.stderr)
            return 1
        print("rolled back " + ", ".join(f"{m} v{old} -> v{new}" for m, (old, new) in plan.items()))
    elif a.action == "verify":
        bad = 0
        for name, problems in verify(a.repository).items():
            bad += bool(problems)
            print(f"{name:20s} " + ("; ".join(problems) if problems else "ok"))
        return 1 if bad else 0
    else:
        for model, info in describe(a.repository).items():
            vs = info["versions"]
            shown = ", ".join(f"{v}{' (newest: served)' if v == vs[-1] else ''}" for v in vs) or "-"
            print(f"{model:16s} versions: {shown}" + (f"   retired: {info['retired']}" if info["retired"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
