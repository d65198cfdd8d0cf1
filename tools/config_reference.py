#!/usr/bin/env python3
"""Regenerate the configuration key reference in numa-infer.toml(5) (only there: README.md
links to it), and the shipped example etc/numa-infer.toml, from the schema (numad_infer/config/schema.py); `--check`
only says whether they are up to date (exit 1 when not). tests/test_docs.py runs the check."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from numad_infer.config import example  # noqa: E402
from numad_infer.config import reference as configref  # noqa: E402

TARGETS = {
    ROOT / "packaging/man/numa-infer.toml.5": (configref.MAN_BEGIN, configref.MAN_END, configref.man_sections),
}
# Files generated whole: the operator edits the installed copy, so it carries no markers.
WHOLE = {ROOT / example.PATH: example.example_toml}
# A file that has only the bare marker (first generation) gets the full region.
BARE = {ROOT / "packaging/man/numa-infer.toml.5": '.\\" config-keys:\n'}


def render(path: Path) -> str:
    if path in WHOLE:
        return WHOLE[path]()
    begin, end, generate = TARGETS[path]
    text = path.read_text()
    if begin not in text:
        bare = BARE[path]
        return text.replace(bare, generate() + ("\n" if bare.endswith("\n") else ""), 1)
    return configref.replace_between(text, begin, end, generate())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    stale = [path for path in (*TARGETS, *WHOLE) if render(path) != path.read_text()]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)}: out of date with the schema; run tools/config_reference.py")
        return 1 if stale else 0
    for path in stale:
        path.write_text(render(path))
        print(f"rewrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
