"""The module -> layer map (numad_infer/layers.py) holds: every module is in it, and no
module imports from a higher layer. Imports are read from the source with `ast`, so one
inside a function or under `if TYPE_CHECKING:` counts like any other (layers.py says why)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import numad_infer
from numad_infer import errors, layers

PACKAGE = Path(numad_infer.__file__).parent


def package_modules() -> list[str]:
    return sorted(path.stem for path in PACKAGE.glob("*.py"))


def imported_modules(source: str) -> set[str]:
    """numad_infer modules that `source` imports, anywhere in it (functions, TYPE_CHECKING blocks)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {_module_of(alias.name) for alias in node.names if alias.name.startswith("numad_infer")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "numad_infer":
                # `from numad_infer import holds` names a module; `... import __version__` the package.
                found |= {a.name if (PACKAGE / f"{a.name}.py").exists() else "__init__" for a in node.names}
            elif node.module.startswith("numad_infer."):
                found.add(_module_of(node.module))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"relative import of {node.module!r}: write it as `from numad_infer...`")
    return found


def _module_of(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_is_in_the_layer_map_and_the_map_names_no_module_that_is_gone() -> None:
    mapped = set(layers.MODULES)
    present = set(package_modules())
    assert present - mapped == set(), "add these to numad_infer/layers.py MODULES (one line each)"
    assert mapped - present == set(), "remove these from numad_infer/layers.py MODULES: no such module"
    assert {layer for layer, _ in layers.MODULES.values()} <= set(layers.ORDER)


@pytest.mark.parametrize("name", package_modules())
def test_no_module_imports_from_a_higher_layer(name: str) -> None:
    rank = {m.name: m.rank for m in layers.modules()}
    if name not in rank:
        pytest.skip("not in the map (the test above fails for it)")
    higher = sorted(dep for dep in imported_modules((PACKAGE / f"{name}.py").read_text())
                    if dep in rank and rank[dep] > rank[name])
    assert not higher, (f"{name} ({layers.MODULES[name][0]}) imports from a higher layer: "
                        + ", ".join(f"{d} ({layers.MODULES[d][0]})" for d in higher))


def test_the_import_reader_sees_imports_in_functions_and_type_checking_blocks() -> None:
    source = inspect.cleandoc("""
        from typing import TYPE_CHECKING
        import numad_infer.sysfs
        from numad_infer import __version__, holds
        if TYPE_CHECKING:
            from numad_infer.planner import Plan
        def f():
            from numad_infer.daemon import Daemon
    """)
    assert imported_modules(source) == {"sysfs", "__init__", "holds", "planner", "daemon"}


def test_every_error_class_is_a_numa_infer_error() -> None:
    """One hierarchy, so `cli.main` catches every operator-facing error in one `except`.
    CpuListError is a ValueError on purpose: pydantic validators turn it into a ConfigError."""
    import importlib

    outside = []
    for name in package_modules():
        if name == "__main__":
            continue  # running it runs the CLI
        module = importlib.import_module(f"numad_infer.{name}" if name != "__init__" else "numad_infer")
        for obj in vars(module).values():
            if (inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == module.__name__
                    and not issubclass(obj, errors.NumaInferError) and obj.__name__ != "CpuListError"):
                outside.append(f"{module.__name__}.{obj.__name__}")
    assert outside == []
