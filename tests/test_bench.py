"""Every benchmark still imports: they run by hand (bench/README.md), not in CI, so a name
moved elsewhere in the package would otherwise break one unnoticed (bench/routing.py and
bench/tune.py did)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__"))
def test_the_benchmark_imports(name: str) -> None:
    module = importlib.import_module(f"bench.{name}")
    assert callable(getattr(module, "main", None)), f"bench/{name}.py has no main()"
