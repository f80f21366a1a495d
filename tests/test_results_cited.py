"""The result files and the docs cite each other both ways: every `perf/results/...` path a document names
exists, and every file under `perf/results/` is named by some document, so the folder holds only results a
reader can find the claim for.

What counts as a citation:
- any text `perf/results/<path>` in a Markdown file of the repository outside `perf/results/` itself (a
  relative link such as `../perf/results/caching.json` contains it too); the folder's own files (RESULTS.md,
  tables written beside the results) cite nothing, since they are what is cited;
- a path ending in `/` names a directory and covers every file below it (`perf/results/gpu/`); the folder
  itself (`perf/results/`) covers nothing;
- `*` and a placeholder in angle brackets (`<data>`) stand for any run of characters within one path part
  (`perf/results/served_eval_beauty*.json`, `perf/results/semantic_id_length_<data>_L<n>.json`).

A cited path exists when its file or directory does, and a pattern when it matches at least one file.
"""
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "perf" / "results"
# folders that hold no document of the project: environments, caches, local runs
SKIPPED_DIRS = {".git", ".venv", ".venv-locust", ".pytest_cache", "runs", "node_modules", "__pycache__"}
CITATION = re.compile(r"perf/results/[A-Za-z0-9_.*<>/-]*")


def documents() -> list[Path]:
    found = []
    for path in ROOT.rglob("*.md"):
        rel = path.relative_to(ROOT)
        if SKIPPED_DIRS.intersection(rel.parts) or path.is_relative_to(RESULTS):
            continue
        found.append(path)
    return sorted(found)


def citations() -> dict[str, list[str]]:
    """cited path relative to perf/results (trailing '/' kept) -> the documents citing it"""
    cited: dict[str, list[str]] = {}
    for doc in documents():
        for match in CITATION.findall(doc.read_text(encoding="utf-8")):
            rel = match[len("perf/results/"):].rstrip(".")  # a sentence's full stop is not part of the path
            if rel:
                cited.setdefault(rel, []).append(str(doc.relative_to(ROOT)))
    return cited


def _pattern(rel: str) -> str:
    return re.sub(r"<[^<>/]*>", "*", rel)


def _covers(rel: str, file: str) -> bool:
    if rel.endswith("/"):
        return file.startswith(rel)
    if "*" in rel or "<" in rel:
        pattern = _pattern(rel)
        return file.count("/") == pattern.count("/") and fnmatch.fnmatchcase(file, pattern)
    return file == rel


def result_files() -> list[str]:
    return sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def test_the_documents_cite_results():
    assert any(d.name == "performance.md" for d in documents())
    assert citations(), "no document cites perf/results/"


def test_every_cited_result_exists():
    files = result_files()
    missing = {}
    for rel, docs in citations().items():
        if rel.endswith("/"):
            ok = (RESULTS / rel).is_dir()
        elif "*" in rel or "<" in rel:
            ok = any(_covers(rel, f) for f in files)
        else:
            ok = (RESULTS / rel).is_file()
        if not ok:
            missing[f"perf/results/{rel}"] = sorted(set(docs))
    assert not missing, f"cited but not in perf/results/: {missing}"


def test_every_result_file_is_cited():
    cited = list(citations())
    uncited = [f for f in result_files() if not any(_covers(rel, f) for rel in cited)]
    assert not uncited, f"in perf/results/ but cited by no document (cite it or delete it): {uncited}"


def test_the_rules_of_a_citation():
    assert _covers("gpu/", "gpu/fp32/gpu_kernels.md")
    assert not _covers("gpu/", "gpu_kernels.md")
    assert _covers("served_eval_beauty*.json", "served_eval_beauty_refit.json")
    assert not _covers("served_eval_beauty*.json", "gpu/served_eval_beauty.json")
    assert _covers("semantic_id_length_<data>_L<n>.json", "semantic_id_length_amazon-beauty_L6.json")
    assert not _covers("caching.json", "gpu/caching.json")
