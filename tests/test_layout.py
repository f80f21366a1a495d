"""The repository's shape stays readable: thin Triton adapters, serving modules of one concern each,
and a front door that fits on a screen.

- each `model_repository/<model>/model.py` is an adapter over a stage module of the package (at most
  150 lines; the request handling lives in `backend_src/serving/stages/`, tested without Triton);
- no module of `backend_src/serving/` is over 500 lines;
- README.md is at most 300 lines, none longer than 200 characters.

The import rules (no circle, no arrow from the package up into the exporters, perf or the client)
are checked in test_import_graph.py.
"""
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


@pytest.mark.parametrize("model_py", sorted((REPO / "model_repository").glob("*/model.py")), ids=lambda p: p.parent.name)
def test_each_triton_model_is_a_thin_adapter(model_py):
    assert _lines(model_py) <= 150, f"{model_py.relative_to(REPO)}: {_lines(model_py)} lines"


def test_the_stages_live_in_the_package():
    stages = {p.stem for p in (REPO / "backend_src" / "serving" / "stages").glob("*.py")}
    assert {"encoder", "decoder", "ranker"} <= stages


def test_no_serving_module_over_500_lines():
    over = {str(p.relative_to(REPO)): _lines(p) for p in (REPO / "backend_src" / "serving").rglob("*.py") if _lines(p) > 500}
    assert over == {}


def test_readme_fits_on_a_screen():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300
    assert [i + 1 for i, line in enumerate(lines) if len(line) > 200] == []
