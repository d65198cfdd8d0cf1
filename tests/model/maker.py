"""tools/make_model.py imported as a module, for the tests that build models with its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "make_model.py"


def make_model_module():
    spec = importlib.util.spec_from_file_location("make_model", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
