"""Triton's floor: the `recommend` ensemble with no-op stages (``model.py`` here), served by a
real tritonserver from configs generated exactly as the real ones, so that every served number
can stand beside what Triton itself costs for the same requests."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

NOOP_MODEL = Path(__file__).resolve().parent / "model.py"


def write_floor_repository(repository, cfg, options) -> Path:
    """A model repository with the real configs (names, contract, batching) and the no-op model
    as version 1 of every Python stage."""
    from genrec_contract import protocol as P
    from export.publish import ENSEMBLE_VERSION
    from export.triton_configs import write_configs

    repository = Path(repository)
    write_configs(repository, cfg, options)
    for model in P.PYTHON_MODELS:
        (repository / model / "1").mkdir(parents=True, exist_ok=True)
        shutil.copy2(NOOP_MODEL, repository / model / "1" / "model.py")
    (repository / P.ENSEMBLE / str(ENSEMBLE_VERSION)).mkdir(parents=True, exist_ok=True)
    return repository


@contextlib.contextmanager
def floor_server(cfg, options, workdir=None, start_timeout_s: float = 120.0):
    """A tritonserver on free ports serving the no-op ensemble. Yields the server."""
    from perf.served_eval import serve_repository

    with tempfile.TemporaryDirectory(prefix="genrec-floor-", dir=workdir) as tmp:
        with serve_repository(write_floor_repository(Path(tmp) / "model_repository", cfg, options), start_timeout_s) as server:
            yield server
