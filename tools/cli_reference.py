#!/usr/bin/env python3
"""Regenerate the man page's SYNOPSIS (packaging/man/numa-infer.8) and the bash completion
(packaging/completion/numa-infer.bash) from the command line's parser, and the man page's
paragraph on routing and queueing from docs/frontdoor.md's (one text, so the two cannot
disagree); `--check` only says whether they are up to date (exit 1 when not).
tests/test_docs.py runs the check."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from numad_infer.cli import reference  # noqa: E402
from numad_infer.cli.main import build_parser  # noqa: E402
from numad_infer.config.reference import replace_between  # noqa: E402

MAN = ROOT / "packaging/man/numa-infer.8"
COMPLETION = ROOT / "packaging/completion/numa-infer.bash"
FRONTDOOR_DOC = ROOT / "docs/frontdoor.md"
DOC_BEGIN, DOC_END = "<!-- routing: ", "<!-- end of routing -->"
MAN_ROUTING_BEGIN = '.\\" routing: copied from docs/frontdoor.md by tools/cli_reference.py; do not edit'
MAN_ROUTING_END = '.\\" end of routing'


def _roff(markdown: str) -> str:
    """The paragraph's Markdown as man page text: `code` in bold, one sentence a line (as
    roff wants), backslashes and hyphens escaped."""
    text = " ".join(markdown.split()).replace("\\", "\\e").replace("-", "\\-")
    text = re.sub(r"`([^`]+)`", lambda m: "\\fB" + m.group(1) + "\\fR", text)
    lines = re.split(r"(?<=[.;:]) (?=[A-Z(`\\])", text)
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in lines)


def routing_paragraph() -> str:
    doc = FRONTDOOR_DOC.read_text()
    start = doc.index(DOC_BEGIN)
    body = doc[doc.index("\n", start) + 1:doc.index(DOC_END)]
    return f"{MAN_ROUTING_BEGIN}\n{_roff(body)}\n{MAN_ROUTING_END}"


def rendered() -> dict[Path, str]:
    parser = build_parser()
    man = MAN.read_text()
    man = replace_between(man, reference.MAN_BEGIN, reference.MAN_END, reference.man_synopsis(parser))
    return {MAN: replace_between(man, MAN_ROUTING_BEGIN, MAN_ROUTING_END, routing_paragraph()),
            COMPLETION: reference.bash_completion(parser)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    stale = [path for path, text in rendered().items() if path.read_text() != text]
    for path in stale:
        if args.check:
            print(f"{path.relative_to(ROOT)}: out of date; run tools/cli_reference.py")
        else:
            path.write_text(rendered()[path])
            print(f"rewrote {path.relative_to(ROOT)}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
