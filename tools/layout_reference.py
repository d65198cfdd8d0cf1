#!/usr/bin/env python3
"""Regenerate the module list in CONTRIBUTING.md's "Layout" section from numad_infer/layers.py;
`--check` only says whether it is up to date (exit 1 when not). tests/test_docs.py runs
the check."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from numad_infer import layers  # noqa: E402
from numad_infer.config.reference import replace_between  # noqa: E402

README = ROOT / "CONTRIBUTING.md"


def render(text: str) -> str:
    return replace_between(text, layers.README_BEGIN, layers.README_END, layers.markdown())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = README.read_text()
    if render(text) == text:
        return 0
    if args.check:
        print(f"{README.relative_to(ROOT)}: module layout out of date; run tools/layout_reference.py")
        return 1
    README.write_text(render(text))
    print(f"rewrote {README.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
