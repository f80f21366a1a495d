"""Self-contained versions: each version directory holds the package it runs, its own stage's
part of the checkpoint and a manifest, and no absolute path. A rollback serves the old
version's code, not today's, and a repository copied elsewhere serves the same answers.

The tests that start a real tritonserver are marked `server`; the others only publish."""
import hashlib
import json
import re
import shutil

import numpy as np
import pytest
import torch

import backend_src
from backend_src.config import DecodeOptions
from backend_src.model.recommender import STAGE_PARTS, GenerativeRecommender
from genrec_contract import protocol as P
from export import publish as pub
from export.triton_configs import ServingOptions
from serving_helpers import build_tiny_checkpoint, require_tritonserver

grpcclient = pytest.importorskip("tritonclient.grpc")

NUM_ITEMS = 40
MAX_HISTORY = 16
DECODE = DecodeOptions(mode="pfa", beam_width=8, k=8, r=0.5, selection_step=1)
TOP_K = 5
SHIFT = 1000.0  # what the changed package adds to every fused score
CHANGED_VERSION = backend_src.__version__ + "+changed"
ITEM_IDS = [None] + [f"sku-{i}" for i in range(1, NUM_ITEMS + 1)]


def _no_machine_paths(root, *paths) -> list:
    """Files under `root` whose bytes hold one of `paths` (absolute paths of this machine)."""
    needles = [str(p).encode() for p in paths]
    return [str(f.relative_to(root)) for f in root.rglob("*") if f.is_file() and any(n in f.read_bytes() for n in needles)]


# ------------------------------------------------------------------------------ no server
@pytest.fixture()
def checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    build_tiny_checkpoint(path, ITEM_IDS, MAX_HISTORY, seed=3)
    return path


def test_a_version_holds_its_package_its_stage_and_a_manifest(tmp_path, checkpoint):
    repo = tmp_path / "repo"
    options = ServingOptions(decode=DECODE, top_k=TOP_K)
    assert pub.publish(checkpoint, repo, options) == {m: 1 for m in P.PYTHON_MODELS}  # with the ONNX export
    sources = sorted(p.relative_to(pub.PROJECT_ROOT) for pkg in pub.PACKAGES
                     for p in (pub.PROJECT_ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)
    for model, stage in pub.STAGES.items():
        vdir = repo / model / "1"
        copied = sorted(p.relative_to(vdir) for pkg in pub.PACKAGES for p in (vdir / pkg).rglob("*") if p.is_file())
        assert copied == sources  # the packages' .py files, nothing else
        artifacts = {p.name for p in vdir.iterdir() if p.is_file()} - {"model.py", pub.MANIFEST}
        assert artifacts == ({f"{stage}.pt", "ranker.onnx"} if model == P.RANKER else {f"{stage}.pt"})
        m = pub.read_manifest(vdir)
        assert (m["model"], m["version"], m["stage"]) == (model, 1, stage)
        assert m["package"]["name"] == "backend_src" and m["package"]["version"] == backend_src.__version__
        assert m["package"] == pub.package_info(pub.PROJECT_ROOT)
        assert m["checkpoint"] == {"file": "ckpt.pt", "sha256": hashlib.sha256(checkpoint.read_bytes()).hexdigest()}
        assert m["serving_options"] == options.to_dict()
        assert m["exported"] == ({"ranker.onnx": "exported"} if model == P.RANKER else {})
        assert m["files"][f"{stage}.pt"] == hashlib.sha256((vdir / f"{stage}.pt").read_bytes()).hexdigest()
        assert len(m["files"]) == len(sources) + len(artifacts) + 1  # + model.py
    assert all(not problems for problems in pub.verify(repo).values())
    # no path of this machine in any file: not the repository's, not the checkout's
    assert _no_machine_paths(repo, tmp_path, pub.PROJECT_ROOT) == []
    assert "/" not in "".join(re.findall(r'string_value: "([^"]*)"', (repo / P.ENCODER / "config.pbtxt").read_text()))

    # a changed, a missing or an extra file is found
    enc = repo / P.ENCODER / "1"
    (enc / "backend_src" / "config.py").write_text("changed = True\n")
    (repo / P.DECODER / "1" / "decoder.pt").unlink()
    (repo / P.RANKER / "1" / "notes.txt").write_text("x")
    found = pub.verify(repo)
    assert found[f"{P.ENCODER}/1"] == ["changed backend_src/config.py"]
    assert found[f"{P.DECODER}/1"] == ["missing decoder.pt"]
    assert found[f"{P.RANKER}/1"] == ["not in the manifest: notes.txt"]
    assert pub.main(["verify", "--repository", str(repo)]) == 1


def test_each_stage_loads_only_its_part_and_answers_as_the_checkpoint(tmp_path, checkpoint):
    from backend_src.serving.ranker_runtime import RankerRuntime

    repo = tmp_path / "repo"
    pub.publish(checkpoint, repo, export_ranker=False)
    full = GenerativeRecommender.load(checkpoint)
    enc, dec, rank, cat = (GenerativeRecommender.load(repo / m / "1" / f"{s}.pt") for m, s in pub.STAGES.items())
    for stage, model in (("encoder", enc), ("decoder", dec), ("ranker", rank), ("catalog", cat)):
        assert model.stage == stage and model.parts == STAGE_PARTS[stage]
        assert model.codebook is not None and list(model.item_ids) == ITEM_IDS  # each places the catalog's items
    assert enc.decoder is None and enc.ranker is None
    assert dec.backbone is None and dec.ranker is None
    assert rank.decoder is None
    assert cat.backbone is None and cat.decoder is None and cat.ranker is None
    assert not any(k.startswith("decoder.") for k in enc.state_dict())
    with pytest.raises(ValueError, match="whole model"):
        enc.save(tmp_path / "x.pt")

    items = torch.tensor([[3, 9, 14, 27, 31]])
    ts = 1000 + 60 * torch.arange(5)[None]
    args = (items, torch.ones_like(items), ts, torch.tensor([5]))
    with torch.no_grad():
        want, got = full.encode(*args), enc.encode(*args)
        assert torch.equal(want.states, got.states) and torch.equal(want.keys, got.keys)
        beams, beams_dec = full.retrieve(want, DECODE), dec.retrieve(got, DECODE)
        assert torch.equal(beams.item_ids, beams_dec.item_ids) and torch.equal(beams.log_probs, beams_dec.log_probs)
        scores = full.rank(want, beams.item_ids)
        assert torch.equal(scores, rank.rank(got, beams.item_ids))
    # the torch runtime of a version without an ONNX export reads the version's ranker.pt
    runtime = RankerRuntime.from_version_dir(repo / P.RANKER / "1", backend="auto")
    assert runtime.backend == "torch"
    np.testing.assert_array_equal(runtime.score_cache(got, beams.item_ids).numpy(), scores.numpy())


def test_publish_needs_a_package_root(tmp_path, checkpoint):
    with pytest.raises(FileNotFoundError, match="not a package root"):
        pub.publish(checkpoint, tmp_path / "repo", package_root=tmp_path, export_ranker=False)
    assert not (tmp_path / "repo").exists()


# ------------------------------------------------------------------------------ served
def _changed_package(root):
    """A package root whose code differs from this checkout's in two observable ways: its
    __version__ (each stage logs the one it imported) and the fused score (+ SHIFT)."""
    for pkg in pub.PACKAGES:
        pub.copy_package(pub.PROJECT_ROOT / pkg, root / pkg)
    for m in P.PYTHON_MODELS:
        (root / "model_repository" / m).mkdir(parents=True)
        shutil.copy2(pub.PROJECT_ROOT / "model_repository" / m / "model.py", root / "model_repository" / m / "model.py")
    for rel, old, new in (
        ("__init__.py", f'__version__ = "{backend_src.__version__}"', f'__version__ = "{CHANGED_VERSION}"'),
        ("model/recommender.py", "scores = log_probs + weight * rank_scores\n",
         f"scores = log_probs + weight * rank_scores + {SHIFT}\n"),
    ):
        path = root / "backend_src" / rel
        text = path.read_text()
        assert text.count(old) == 1, (rel, old)
        path.write_text(text.replace(old, new))
    return root


def _loaded(log_file) -> list:
    """(model, version, package version) of every stage load the server logged, in order."""
    return re.findall(r"(\w+) v(\d+): backend_src ([^\s\"]+)", log_file.read_text(errors="replace"))


def _recommend(client, sid, items):
    """One visit (START and END) with the whole history: the answer depends on the served
    versions only, not on any session state."""
    n = len(items)

    def tensor(spec, array):
        t = grpcclient.InferInput(spec.name, list(array.shape), spec.dtype)
        t.set_data_from_numpy(array)
        return t

    inputs = [
        tensor(P.ITEM_IDS, np.array([[x.encode() for x in items]], dtype=object)),
        tensor(P.ACTIONS, np.ones((1, n), np.int64)),
        tensor(P.TIMESTAMPS, (1000 + 60 * np.arange(n, dtype=np.int64))[None]),
    ]
    r = client.infer(P.ENSEMBLE, inputs, sequence_id=sid, sequence_start=True, sequence_end=True, client_timeout=60)
    return [x.decode() for x in r.as_numpy("RECOMMENDED_IDS")[0]], r.as_numpy("RANK_SCORES")[0].copy()


def _offline(checkpoint, items):
    model = GenerativeRecommender.load(checkpoint)
    idx = torch.as_tensor(model.item_indices(items))[None]
    ts = 1000 + 60 * torch.arange(len(items))[None]
    with torch.no_grad():
        rec = model.recommend(model.encode(idx, torch.ones_like(idx), ts, torch.tensor([len(items)])), DECODE, top_k=TOP_K)
    return [model.item_ids[i] or "" for i in rec.items[0].tolist()], rec.rank_scores[0].numpy()


@pytest.mark.server
def test_rollback_serves_the_old_code_and_a_copied_repository_serves_elsewhere(tmp_path):
    from backend_src.serving.processes import free_port
    from backend_src.serving.server import TritonServer

    require_tritonserver()
    ckpt = tmp_path / "v1.pt"
    build_tiny_checkpoint(ckpt, ITEM_IDS, MAX_HISTORY, seed=5)
    repo = tmp_path / "site" / "model_repository"
    options = ServingOptions(decode=DECODE, top_k=TOP_K, visit_idle_s=60, max_queue_delay_us=500)
    history = [f"sku-{i}" for i in (2, 8, 13, 21, 34, 35)]
    pub.publish(ckpt, repo, options, export_ranker=False)  # the ranker in torch: the changed code runs in it

    log = tmp_path / "tritonserver.log"
    server = TritonServer(repo, free_port(), free_port(), free_port(), log_file=log, exit_timeout_s=5)
    with server.start(timeout_s=180):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        ids1, scores1 = _recommend(client, 1, history)
        want_ids, want_scores = _offline(ckpt, history)
        assert ids1 == want_ids
        np.testing.assert_allclose(scores1, want_scores, rtol=1e-4, atol=1e-4)
        assert sorted(_loaded(log)) == sorted((m, "1", backend_src.__version__) for m in P.PYTHON_MODELS)

        # v2: the same weights, changed code
        changed = _changed_package(tmp_path / "changed")
        assert pub.publish(ckpt, repo, options, server=server.grpc_url, package_root=changed,
                           export_ranker=False) == {m: 2 for m in P.PYTHON_MODELS}
        for m in P.PYTHON_MODELS:
            assert client.get_model_metadata(m).versions == ["2"], m
            assert pub.read_manifest(repo / m / "2")["package"]["version"] == CHANGED_VERSION
        ids2, scores2 = _recommend(client, 2, history)
        assert ids2 == ids1  # a shift of every score keeps the order
        np.testing.assert_allclose(scores2, scores1 + SHIFT, atol=1e-3)
        assert {(m, "2", CHANGED_VERSION) for m in P.PYTHON_MODELS} <= set(_loaded(log))

        # roll back: v1 loads again with v1's code, and answers as before
        pub.rollback(repo, server=server.grpc_url)
        for m in P.PYTHON_MODELS:
            assert client.get_model_metadata(m).versions == ["1"], m
        ids3, scores3 = _recommend(client, 3, history)
        assert ids3 == ids1
        np.testing.assert_array_equal(scores3, scores1)
        loads = _loaded(log)
        for m in P.PYTHON_MODELS:
            assert loads.count((m, "1", backend_src.__version__)) == 2, m  # at start and at the rollback
        assert not [x for x in loads if x[1] == "1" and x[2] == CHANGED_VERSION]
        client.close()

    # copy the repository to another parent (as to another host) and take the original away
    elsewhere = tmp_path / "elsewhere" / "deeper" / "repo-copy"
    shutil.copytree(repo, elsewhere, ignore=shutil.ignore_patterns("__pycache__"))
    assert _no_machine_paths(elsewhere, tmp_path, pub.PROJECT_ROOT) == []
    assert all(not problems for problems in pub.verify(elsewhere).values())
    repo.rename(repo.with_name("gone"))
    shutil.rmtree(changed)
    log2 = tmp_path / "elsewhere.log"
    server = TritonServer(elsewhere, free_port(), free_port(), free_port(), log_file=log2, exit_timeout_s=5)
    with server.start(timeout_s=180):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        ids4, scores4 = _recommend(client, 4, history)
        client.close()
    assert ids4 == ids1
    np.testing.assert_array_equal(scores4, scores1)
    assert sorted(_loaded(log2)) == sorted((m, "1", backend_src.__version__) for m in P.PYTHON_MODELS)
    assert (elsewhere.parent / "repo-copy-events" / "events.sqlite3").exists()  # its own log, beside it
    assert json.loads((elsewhere / P.ENCODER / "1" / pub.MANIFEST).read_text())["checkpoint"]["file"] == "v1.pt"
