"""The test suite's own shape: no module of it imports from a test module. What tests share
lives in helper modules (tests/daemon_harness.py, tests/unitfiles.py, tests/frontdoor/harness.py,
...) and fixtures in conftest.py, so running one test file never collects another's tests
under its name, and moving a test never breaks a second file."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_test_module(dotted: str) -> bool:
    return dotted.rsplit(".", 1)[-1].startswith("test_")


def imports_of_test_modules(source: str, where: str) -> list[str]:
    """`where:line imports module` for each import in `source` (at any depth) of a test_* module."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.ImportFrom):  # relative: from . import test_x, from .test_x import y
            names = [node.module or "", *(alias.name for alias in node.names)]
        found += [f"{where}:{node.lineno} imports {name}"
                  for name in names if name and _is_test_module(name)]
    return found


def test_no_module_of_the_suite_imports_from_a_test_module() -> None:
    offending = [line for path in sorted(TESTS.rglob("*.py"))
                 for line in imports_of_test_modules(path.read_text(), str(path.relative_to(TESTS.parent)))]
    assert not offending, "move what is shared into a helper module or conftest.py:\n" + "\n".join(offending)


def test_the_check_sees_an_import_from_a_test_module_at_any_depth() -> None:
    sample = ("from tests.units.test_render import directives\nfrom tests.unitfiles import directives\n"
              "def f():\n    import tests.model.test_gguf\n    from tests.model import test_gguf, raw\n"
              "    from . import test_layers\n")
    assert sorted(line.split(" imports ")[1] for line in imports_of_test_modules(sample, "sample.py")) == sorted([
        "tests.units.test_render", "tests.model.test_gguf", "tests.model.test_gguf", "test_layers"])
