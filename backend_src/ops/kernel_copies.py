"""Private copies of the Triton kernels, loaded from a path under a module name of their own.

Triton fixes interpreter or compile mode when ``@triton.jit`` functions are decorated, that is when
their module is imported. A private copy is decorated in the mode of the moment and leaves
``backend_src.ops.triton_kernels`` alone: the CPU tests run one copy in Triton's interpreter and
compile another for a GPU target, and the GPU benchmark times another version of the kernels (the
package of another commit, or a single-file version) beside this one.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

KERNELS_PACKAGE = Path(__file__).resolve().parent / "triton_kernels"


def load_copy(path: Path | str, name: str) -> ModuleType:
    """The kernels at `path` (a package directory or one .py file) as the module `name`; a package's
    modules become `name.<module>` (their relative imports resolve inside the copy)."""
    path = Path(path)
    if path.is_dir():
        spec = importlib.util.spec_from_file_location(name, path / "__init__.py",
                                                      submodule_search_locations=[str(path)])
    else:
        spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        raise
    return module


def modules_of(copy: ModuleType) -> list[ModuleType]:
    """The copy and, for a package, every module of it loaded (its kernels live there)."""
    prefix = copy.__name__ + "."
    return [copy] + [m for k, m in sorted(sys.modules.items()) if k.startswith(prefix)]
