"""The module map (numad_infer/layers.py) holds: every module is in it, no module imports
from a later package or a higher layer, and no modules import each other in a circle. Imports are read from the source with `ast`, so one
inside a function or under `if TYPE_CHECKING:` counts like any other (layers.py says why)."""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import pytest

import numad_infer
from numad_infer import errors, layers

PACKAGE = Path(numad_infer.__file__).parent


def package_modules() -> list[str]:
    """Every module as its path under numad_infer/ without `.py` (`cli`, `engines/__init__`)."""
    return sorted(str(path.relative_to(PACKAGE).with_suffix("")) for path in PACKAGE.rglob("*.py")
                  if "__pycache__" not in path.parts)


def imported_modules(source: str, importer: str = "__init__") -> set[str]:
    """numad_infer modules that `source` (the module `importer`) imports, anywhere in it:
    functions and TYPE_CHECKING blocks too; relative imports resolved from `importer`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {_key(alias.name.split(".")[1:]) for alias in node.names
                      if alias.name.split(".")[0] == "numad_infer"}
        elif isinstance(node, ast.ImportFrom):
            parts = _absolute(node, importer)
            if parts is None:
                continue
            for alias in node.names:
                # `from numad_infer.supervision import holds` names a module; `... import __version__` a name in one.
                sub = _key([*parts, alias.name])
                found.add(sub if _exists(sub) else _key(parts))
    return found


def _absolute(node: ast.ImportFrom, importer: str) -> list[str] | None:
    """The imported module's parts below numad_infer (None: not numad_infer)."""
    named = node.module.split(".") if node.module else []
    if node.level == 0:
        return named[1:] if named and named[0] == "numad_infer" else None
    package = importer.split("/")[:-1]  # the folder `importer` sits in
    return package[:len(package) - (node.level - 1)] + named


def _key(parts: list[str]) -> str:
    """Module parts -> the map's key: a module file, or a package's __init__."""
    path = "/".join(parts)
    return path if (PACKAGE / f"{path}.py").is_file() else "/".join([*parts, "__init__"])


def _exists(key: str) -> bool:
    return (PACKAGE / f"{key}.py").is_file()


def _dotted(key: str) -> str:
    return ".".join(["numad_infer", *key.split("/")]).removesuffix(".__init__")


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
    higher = sorted(dep for dep in imported_modules((PACKAGE / f"{name}.py").read_text(), name)
                    if dep in rank and rank[dep] > rank[name])
    assert not higher, (f"{name} ({layers.MODULES[name][0]}) imports from a higher layer: "
                        + ", ".join(f"{d} ({layers.MODULES[d][0]})" for d in higher))


def _imports_of(name: str) -> set[str]:
    return imported_modules((PACKAGE / f"{name}.py").read_text(), name) - {name}


@pytest.mark.parametrize("name", package_modules())
def test_no_module_imports_from_a_later_package(name: str) -> None:
    by_name = {m.name: m for m in layers.modules()}
    if name not in by_name:
        pytest.skip("not in the map (the first test fails for it)")
    later = sorted(dep for dep in _imports_of(name)
                   if dep in by_name and by_name[dep].package_rank > by_name[name].package_rank)
    assert not later, (f"{name} (package {by_name[name].package or 'top level'}) imports from a later package: "
                       + ", ".join(later) + "; move the shared part down, or the importer up (layers.PACKAGES)")


def test_no_modules_import_each_other_in_a_circle() -> None:
    """Strongly connected components of the import graph (Tarjan's algorithm) all of size 1:
    a circle within one package and layer passes the two rules above, and still means that
    neither module can be read, tested or moved without the other."""
    graph = {name: sorted(_imports_of(name)) for name in package_modules()}
    circles = [sorted(c) for c in _components(graph) if len(c) > 1]
    assert circles == []


def _components(graph: dict[str, list[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in graph.get(node, []):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            found.append(component)

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_finds_a_circle_and_passes_a_chain() -> None:
    assert sorted(map(sorted, _components({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}))) == [["a", "b", "c"],
                                                                                                  ["d"]]
    assert all(len(c) == 1 for c in _components({"a": ["b"], "b": ["c"], "c": []}))


def test_the_import_reader_sees_imports_in_functions_and_type_checking_blocks() -> None:
    source = inspect.cleandoc("""
        from typing import TYPE_CHECKING
        import numad_infer.topology.sysfs
        from numad_infer import __version__
        from numad_infer.supervision import holds
        if TYPE_CHECKING:
            from numad_infer.plan.model import Plan
        def f():
            from numad_infer.daemon.loop import Daemon
    """)
    assert imported_modules(source) == {"topology/sysfs", "__init__", "supervision/holds", "plan/model",
                                        "daemon/loop"}


def test_the_import_reader_resolves_modules_of_a_sub_package(tmp_path: Path, monkeypatch) -> None:
    for rel in ("__init__.py", "cli.py", "pkg/__init__.py", "pkg/a.py", "pkg/b.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert package_modules() == ["__init__", "cli", "pkg/__init__", "pkg/a", "pkg/b"]
    source = "from . import b\nfrom .a import X\nfrom .. import cli\nimport numad_infer.pkg\nfrom numad_infer.pkg import a"
    assert imported_modules(source, "pkg/b") == {"pkg/b", "pkg/a", "cli", "pkg/__init__"}
    assert _dotted("pkg/__init__") == "numad_infer.pkg" and _dotted("pkg/a") == "numad_infer.pkg.a"


def test_every_error_class_is_a_numa_infer_error() -> None:
    """One hierarchy, so `cli.main` catches every operator-facing error in one `except`.
    CpuListError is a ValueError on purpose: pydantic validators turn it into a ConfigError."""
    import importlib

    outside = []
    for name in package_modules():
        if name == "__main__":
            continue  # running it runs the CLI
        module = importlib.import_module(_dotted(name))
        for obj in vars(module).values():
            if (inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == module.__name__
                    and not issubclass(obj, errors.NumaInferError) and obj.__name__ != "CpuListError"):
                outside.append(f"{module.__name__}.{obj.__name__}")
    assert outside == []


MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 400, 200, 60


@pytest.mark.parametrize("name", package_modules())
def test_no_module_class_or_function_outgrows_what_a_reader_takes_in_at_once(name: str) -> None:
    """At most 400 lines a module, 200 a class, 60 a function: past that a module has more
    than one job, and the next reader cannot find the one they came for."""
    source = (PACKAGE / f"{name}.py").read_text()
    too_big = [f"the module: {source.count(chr(10))} lines"] if source.count("\n") > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(source)):
        limit = (MAX_CLASS_LINES if isinstance(node, ast.ClassDef)
                 else MAX_FUNCTION_LINES if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None)
        if limit is not None and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > limit:
            too_big.append(f"{node.name}: {node.end_lineno - node.lineno + 1} lines (at most {limit})")
    assert too_big == [], f"numad_infer/{name}.py: split it by job"


# A module imported under a name of its own choosing; every other one keeps its module's name.
ALIASES = {"tuner"}  # cli/commands: `tune.run`, beside the commands' own `run`


def test_no_docstring_comment_or_import_alias_names_a_module_that_is_gone() -> None:
    # Renamed modules lived on in prose (`supervise.py`, `driftchecks`) and in aliases
    # (`pipeline as loading`, `publish as snapshot`): a reader looked for files that are not there.
    import re

    root = PACKAGE.parent
    stems = {path.stem for path in PACKAGE.rglob("*.py")}
    named = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*\w+)\.py\b")
    gone, aliased = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        for lineno, line in enumerate(source.splitlines(), 1):
            for ref in named.findall(line):
                found = ((root / f"{ref}.py").exists() or (PACKAGE / f"{ref}.py").exists()) if "/" in ref \
                    else ref in stems
                if not found:
                    gone.append(f"{path.relative_to(root)}:{lineno}: {ref}.py")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("numad_infer"):
                aliased += [f"{path.relative_to(root)}: {node.module}.{a.name} as {a.asname}" for a in node.names
                            if a.asname and a.asname != a.name and a.asname not in ALIASES
                            and (PACKAGE.joinpath(*node.module.split(".")[1:], f"{a.name}.py")).exists()]
    assert not gone, "names a module that does not exist:\n" + "\n".join(gone)
    assert not aliased, "a module imported under another module-like name:\n" + "\n".join(aliased)
