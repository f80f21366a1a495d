"""The client is a package of its own: `clients` plus the tensor contract, numpy and tritonclient only.

(a) With torch and every other part of the project refused at import (backend_src whole), `import
    clients`, the client class and `python -m clients.cli --help` still work.
(b) The distribution's metadata (pyproject.toml) depends on numpy and tritonclient only, pinned as
    in requirements.txt.
(c) Where setuptools is installed, the wheel built offline holds exactly the client modules and
    the contract, and works from its own files with the same imports refused.
"""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

from backend_src.results import REPO_ROOT

pytest.importorskip("tritonclient.grpc")

CLIENT_MODULES = {"clients/__init__.py", "clients/client.py", "clients/cli.py"}
CONTRACT_MODULES = {"genrec_contract/__init__.py", "genrec_contract/protocol.py"}

# Run first in each subprocess: refuse torch, the GPU/JIT stacks, and every part of the project
# other than the client and the contract.
REFUSE_IMPORTS = """
import sys
from importlib.abc import MetaPathFinder

REFUSED = ("torch", "triton", "numba", "onnx", "onnxruntime", "onnxscript", "matplotlib",
           "backend_src", "export", "perf", "examples", "model_repository")


class Refuse(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in REFUSED:
            raise ModuleNotFoundError(f"{name} refused: the client must not need it", name=name)
        return None


sys.meta_path.insert(0, Refuse())
"""

IMPORT_CLIENT = REFUSE_IMPORTS + """
import json

import clients
from clients.client import RecommenderClient
from genrec_contract import protocol

assert clients.RecommenderClient is RecommenderClient
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("backend_src", "torch", "clients", "genrec_contract"))
print(json.dumps({"loaded": loaded, "protocol": protocol.__file__, "clients": clients.__file__}))
"""

CLI_HELP = REFUSE_IMPORTS + """
import runpy

sys.argv = ["clients.cli", "--help"]
runpy.run_module("clients.cli", run_name="__main__", alter_sys=True)
"""


def _python(code: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _check_client_runs(cwd) -> dict:
    """(a) in a subprocess from `cwd`: import the client, run the CLI's --help; returns what loaded."""
    r = _python(IMPORT_CLIENT, cwd)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert not [m for m in info["loaded"] if m.split(".")[0] == "torch"]
    assert not [m for m in info["loaded"] if m.split(".")[0] in ("backend_src", "torch")]

    r = _python(CLI_HELP, cwd)
    assert r.returncode == 0, r.stderr
    for command in ("open", "append", "recommend", "close", "health"):
        assert command in r.stdout
    return info


def test_client_imports_without_torch_or_the_rest_of_the_project():
    info = _check_client_runs(REPO_ROOT)
    assert info["protocol"] == str(REPO_ROOT / "genrec_contract" / "protocol.py")


def _pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


def test_metadata_depends_on_numpy_and_tritonclient_only():
    project = _pyproject()["project"]
    deps = project["dependencies"]
    assert sorted(_name(d) for d in deps) == ["numpy", "tritonclient"]
    # pinned as the project's environment pins them
    pinned = {_name(line): line.strip() for line in (REPO_ROOT / "requirements.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    for d in deps:
        assert d == pinned[_name(d)], f"{d} differs from requirements.txt's {pinned[_name(d)]}"
    assert "optional-dependencies" not in project
    assert project["scripts"] == {"genrec-client": "clients.cli:main"}


def test_wheel_holds_only_the_client_and_the_contract(tmp_path):
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools (the build backend) is not installed: no offline wheel build")
    # Build from a copy: setuptools writes build/ and *.egg-info next to pyproject.toml, and the
    # whole tree is copied so that the package lists, not the copy, decide what goes in.
    src = tmp_path / "src"
    shutil.copytree(REPO_ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-q", "-w", str(dist), "."], cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = dist.glob("genrec_client-*.whl")

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        z.extractall(tmp_path / "installed", members=[n for n in names if ".dist-info/" not in n])
    assert {n for n in names if ".dist-info/" not in n} == CLIENT_MODULES | CONTRACT_MODULES
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert requires == _pyproject()["project"]["dependencies"]

    # the wheel's files alone (run from where they were unpacked, the repository not on the path)
    info = _check_client_runs(tmp_path / "installed")
    assert info["protocol"] == str(tmp_path / "installed" / "genrec_contract" / "protocol.py")
    assert info["clients"] == str(tmp_path / "installed" / "clients" / "__init__.py")
