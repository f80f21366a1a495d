"""Publish a checkpoint as the next version of every served model, roll back, list versions.

    python -m export.publish publish --checkpoint ckpt.pt --repository model_repository [--server localhost:8001]
    python -m export.publish rollback --repository model_repository [--server localhost:8001]
    (reloading needs the server's admin key: GENREC_ADMIN_KEY, or --admin-key-file, default runs/admin.key)
    python -m export.publish list --repository model_repository

publish: each Python model's next version directory (model.py, model.pt = the checkpoint, the
ranker's optional ranker.onnx / ranker.plan, publish.json) is built in a staging folder on the
repository's filesystem and moved into ``<repository>/<model>/<version>/`` with one
``os.rename``, so a server never sees half a version. Then every config.pbtxt is rewritten
(atomically) and, given a server, each model is reloaded: the server loads the new version
while the old one keeps serving, then drops the old one (version_policy latest 1).

rollback: moves the newest version of each model to ``<repository>/<model>/.retired/`` and
reloads, so the previous version serves again. Version numbers only grow: a publish after a
rollback takes a number above the retired ones.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from backend_src.serving import protocol as P
from export.triton_configs import (
    CODE_ROOT,
    ServingOptions,
    add_serving_arguments,
    config_from_checkpoint,
    serving_options_from_args,
    write_configs,
)

RETIRED = ".retired"
ENSEMBLE_VERSION = 1  # the ensemble has no weights: one version that always follows the latest steps
MODEL_SOURCES = CODE_ROOT / "model_repository"  # where each model's model.py lives
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
    model_sources: Path = MODEL_SOURCES,
    export_ranker: bool = True,
    admin_key: str | None = None,
) -> dict:
    """Add the next version of every Python model; returns {model: version}.

    Unless given ready-made files (or export_ranker is False), the ranker is exported to ONNX
    from the checkpoint, and built into a TensorRT plan where TensorRT is importable."""
    checkpoint, repository = Path(checkpoint), Path(repository)
    if server:
        check_server_access(server, admin_key)  # before anything changes
    repository.mkdir(parents=True, exist_ok=True)
    cfg = config_from_checkpoint(checkpoint)
    options = options or ServingOptions()
    meta = {
        "checkpoint": str(checkpoint.resolve()),
        "sha256": _sha256(checkpoint),
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
            shutil.copy2(model_sources / model / "model.py", vdir / "model.py")
            shutil.copy2(checkpoint, vdir / "model.pt")
            if model == P.RANKER:
                if ranker_onnx:
                    shutil.copy2(ranker_onnx, vdir / "ranker.onnx")
                elif export_ranker:
                    _export_ranker(checkpoint, vdir)
                if ranker_plan:
                    shutil.copy2(ranker_plan, vdir / "ranker.plan")
            (vdir / "publish.json").write_text(json.dumps({**meta, "model": model, "version": v}, indent=2))
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
    saved = json.loads((model_dir / str(vs[-1]) / "publish.json").read_text())["serving_options"]
    known = {f.name for f in dataclasses.fields(ServingOptions)}
    opts = {k: v for k, v in saved.items() if k in known}
    opts["decode"] = DecodeOptions(**opts["decode"])
    return ServingOptions(**opts)


def _export_ranker(checkpoint: Path, vdir: Path) -> None:
    """ranker.onnx (always) and ranker.plan (where TensorRT can build one) for this version."""
    from backend_src.model.recommender import GenerativeRecommender
    from export.onnx_ranker import export_ranker_onnx
    from export.tensorrt_ranker import build_tensorrt_plan, default_profiles, tensorrt_available

    model = GenerativeRecommender.load(checkpoint)
    export_ranker_onnx(model, vdir / "ranker.onnx")
    if tensorrt_available()[0]:
        build_tensorrt_plan(vdir / "ranker.onnx", vdir / "ranker.plan", default_profiles(model.cfg))


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
    from backend_src.serving.server import admin_headers, read_admin_key

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
    add_serving_arguments(p)
    r = sub.add_parser("rollback", help="retire the newest version of every model")
    r.add_argument("--repository", default="model_repository")
    r.add_argument("--server", default=None, help=SERVER_HELP)
    r.add_argument("--admin-key-file", default=None, help=ADMIN_KEY_HELP)
    ls = sub.add_parser("list", help="show versions")
    ls.add_argument("--repository", default="model_repository")
    a = ap.parse_args(argv)
    if getattr(a, "server", None) and "," in a.server:
        a.server = [u.strip() for u in a.server.split(",") if u.strip()]
    admin_key = None
    if a.action in ("publish", "rollback") and a.server:
        from backend_src.serving.server import read_admin_key

        admin_key = read_admin_key(a.admin_key_file)
        if a.admin_key_file and admin_key is None:
            print(f"no admin key in {a.admin_key_file}", file=sys.stderr)
            return 1

    from tritonclient.utils import InferenceServerException

    if a.action == "publish":
        try:
            done = publish(a.checkpoint, a.repository, serving_options_from_args(a), a.server, a.ranker_onnx,
                           a.ranker_plan, export_ranker=not a.no_ranker_export, admin_key=admin_key)
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
    else:
        for model, info in describe(a.repository).items():
            vs = info["versions"]
            shown = ", ".join(f"{v}{' (newest: served)' if v == vs[-1] else ''}" for v in vs) or "-"
            print(f"{model:16s} versions: {shown}" + (f"   retired: {info['retired']}" if info["retired"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
