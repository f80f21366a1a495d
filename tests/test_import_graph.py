"""The package's import graph: no circle, and the arrows point one way.

Every module of `backend_src/`, `genrec_contract/` and `clients/` is parsed (no import is run), and
every import statement in it counts, at module level and inside functions alike: a deferred import
closes a circle as surely as a module-level one, only later. An edge goes to the module an import
names: `import a.b.c` and `from a.b import c` (c a module) depend on `a.b.c`; `from a.b import f`
(f a name) depends on `a.b`. A package's `__init__` is not implied by importing its submodules
(Python runs it first, but a submodule that imports a sibling through the package is no circle).
The block under `if __name__ == "__main__":` is left out: it runs only when the file is the program,
as a module of its own (a command line entry point delegating to the module that implements it).

Rules:
- no circle among the modules of `backend_src` and `genrec_contract`;
- the package and the contract reach nothing above them: no `export`, `perf`, `clients`,
  `examples` or `model_repository` (those use the package, not the other way round);
- the contract and the client reach nothing of `backend_src` (the client distribution ships
  without it).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("backend_src", "genrec_contract", "clients")
ABOVE_THE_PACKAGE = ("export", "perf", "clients", "examples", "model_repository")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path = REPO, packages=PACKAGES) -> dict[str, Path]:
    """{dotted module name: file} of every module of `packages` under `root`."""
    return {_module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def _is_main_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def _statements(tree: ast.AST):
    """Every node of `tree` but those under an `if __name__ == "__main__":` block."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo += [child for child in ast.iter_child_nodes(node) if not _is_main_block(child)]


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement of module `name` (its file `path`),
    at any depth of the file (but a `__main__` block). Relative imports are resolved; `from m import x` names the module
    m.x where that is a module of `modules`, else m."""
    is_package = path.name == "__init__.py"
    found = []
    for node in _statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                found.append((sub if sub in modules else base, node.lineno))
    return found


def import_graph(root: Path = REPO, packages=PACKAGES) -> tuple[dict[str, set[str]], dict[str, list]]:
    """(edges among the modules of `packages`, every import of each module with its line)."""
    modules = project_modules(root, packages)
    every = {name: imports_of(name, path, modules) for name, path in modules.items()}
    edges = {name: {m for m, _ in imps if m in modules and m != name} for name, imps in every.items()}
    return edges, every


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def _top(module: str) -> str:
    return module.split(".")[0]


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_sees_the_imports(graph):
    """The parser finds imports of each form: module-level absolute, deferred (inside a function),
    relative, `from package import submodule` and `from module import name`."""
    edges, _ = graph
    assert "backend_src.model.rq_vae" in edges["backend_src.model.semantic_ids"]
    assert "backend_src.model.kmeans" in edges["backend_src.model.rq_vae"]
    assert "backend_src.ops" in edges["backend_src.model.hstu"]  # from backend_src import ops
    assert "backend_src.ops.dispatch" in edges["backend_src.ops"]  # the package's own __init__
    # deferred: the dispatcher imports the kernels package on first use
    assert "backend_src.ops.triton_kernels" in edges["backend_src.ops.dispatch"]
    assert "backend_src.ops.triton_kernels.common" in edges["backend_src.ops.triton_kernels.decode"]  # relative
    assert "genrec_contract.protocol" in edges["clients.client"]


def test_find_cycle_finds_one(tmp_path):
    """A deferred import closing a circle counts, and a package importing its own submodules
    (which import each other through the package) does not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("from pkg import b\n\ndef f():\n    return b.g()\n")
    (pkg / "b.py").write_text("def g():\n    from .c import h\n    return h()\n")
    (pkg / "c.py").write_text("import pkg.d\n\ndef h():\n    return 1\n")
    (pkg / "d.py").write_text("x = 1\n\nif __name__ == '__main__':\n    import pkg.a\n")  # an entry point
    edges, _ = import_graph(tmp_path, ("pkg",))
    assert edges["pkg.b"] == {"pkg.c"} and edges["pkg.c"] == {"pkg.d"}
    assert find_cycle(edges) is None
    (pkg / "d.py").write_text("def k():\n    from pkg.a import f\n    return f\n")
    cycle = find_cycle(import_graph(tmp_path, ("pkg",))[0])
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"pkg.a", "pkg.b", "pkg.c", "pkg.d"}


def test_no_import_circle(graph):
    edges, _ = graph
    inside = {n: {m for m in out if _top(m) in ("backend_src", "genrec_contract")}
              for n, out in edges.items() if _top(n) in ("backend_src", "genrec_contract")}
    cycle = find_cycle(inside)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_package_reaches_nothing_above_it(graph):
    """backend_src and genrec_contract import no exporter, benchmark, client, example or Triton
    model: each offending import is listed with its file and line."""
    _, every = graph
    offending = [f"{name}:{line} imports {module}" for name, imps in sorted(every.items())
                 if _top(name) in ("backend_src", "genrec_contract")
                 for module, line in imps if _top(module) in ABOVE_THE_PACKAGE]
    assert offending == [], "\n".join(offending)


def test_contract_and_client_reach_no_backend_src(graph):
    _, every = graph
    offending = [f"{name}:{line} imports {module}" for name, imps in sorted(every.items())
                 if _top(name) in ("genrec_contract", "clients")
                 for module, line in imps if _top(module) == "backend_src"]
    assert offending == [], "\n".join(offending)
