"""Counting calls: how often a function's code runs, whatever name reaches it. What the
validation door works out once per load (DERIVED) is counted so."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from numad_infer.config import models as config_models
from numad_infer.engines import base as engines_base
from numad_infer.plan import placement

DERIVED = {"served_models": config_models.served_models, "engine_of": engines_base.engine_of,
           "make_plan": placement.make_plan}


@contextmanager
def calls_counted(functions: dict[str, Callable[..., Any]]) -> Iterator[Counter[str]]:
    """How often each function's code runs, whatever name or module it is reached by (a
    profile hook sees every Python call: an alias or a `from x import f` cannot hide one)."""
    codes = {f.__code__: name for name, f in functions.items()}
    counts: Counter[str] = Counter()

    def hook(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield counts
    finally:
        sys.setprofile(previous)
