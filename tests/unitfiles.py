"""Unit files as systemd reads them, for the assertions: its parser (systemd-analyze verify),
its command-line unquoting, directives, and its exposure score (systemd-analyze security)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ANALYZE = shutil.which("systemd-analyze")


def systemd_verify(unit_dir: Path, units: list[str]) -> str:
    """systemd's own parser; returns everything it printed (empty means no warning)."""
    assert ANALYZE, "systemd-analyze is not installed"
    env = dict(os.environ, SYSTEMD_UNIT_PATH=f"{unit_dir}:", SYSTEMD_LOG_LEVEL="notice")
    proc = subprocess.run([ANALYZE, "verify", "--man=no", *units], env=env, capture_output=True, text=True)
    return (proc.stdout + proc.stderr).strip() + ("" if proc.returncode == 0 else f"\n(rc={proc.returncode})")


# -- systemd's command-line unquoting (systemd.service(5), "Command lines"), for the assertions
def systemd_split(line: str) -> list[str]:
    words, i = [], 0
    while i < len(line):
        if line[i] == " ":
            i += 1
            continue
        assert line[i] == '"', f"unquoted word at {line[i:]!r}"
        i += 1
        word = ""
        while line[i] != '"':
            if line[i] == "\\":
                word += {"\\": "\\", '"': '"', "n": "\n", "t": "\t"}[line[i + 1]]
                i += 2
            else:
                word += line[i]
                i += 1
        i += 1
        words.append(word.replace("%%", "%").replace("$$", "$"))
    return words


def directives(text: str) -> list[tuple[str, str]]:
    return [tuple(l.split("=", 1)) for l in text.splitlines() if l and not l.startswith(("#", "["))]


def values_of(text: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(key + "=")]


def exposure(tmp_path: Path, files: dict[str, str], unit: str) -> subprocess.CompletedProcess[str]:
    """`systemd-analyze security --offline=true` on rendered files, copied as the issue says."""
    root = tmp_path / "root"
    for rel, text in files.items():
        target = root / "etc/systemd/system" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return subprocess.run(["systemd-analyze", "security", "--offline=true", f"--root={root}", unit],
                          capture_output=True, text=True)


def score(tmp_path: Path, files: dict[str, str], unit: str, threshold: float) -> float:
    proc = exposure(tmp_path, files, unit)
    found = float(proc.stdout.rsplit("exposure level for", 1)[1].split(":")[1].split()[0])
    # --threshold makes systemd-analyze itself fail above the goal (scores are x10 integers there).
    strict = subprocess.run(["systemd-analyze", "security", "--offline=true", f"--root={tmp_path / 'root'}",
                             f"--threshold={int(threshold * 10)}", unit], capture_output=True, text=True)
    assert strict.returncode == 0, f"{unit}: exposure {found} above {threshold}"
    return found
