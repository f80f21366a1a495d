"""Shared test fixtures."""
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real data sets (../shared/data from the repo root, or GENREC_DATA_DIR); skip if absent."""
    path = Path(os.environ.get("GENREC_DATA_DIR", REPO_ROOT / ".." / "shared" / "data"))
    if not path.is_dir():
        pytest.skip(f"data directory {path} not present")
    return path


def pytest_configure(config):
    config.addinivalue_line("markers", "server: starts a real tritonserver (slower)")
