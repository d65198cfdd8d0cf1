"""The bandwidth `numa-infer tune` measured, kept beside the state file for the daemon, which
shows llama-server's decode as a share of it in status (BW-EFF). The measuring itself is
`bandwidth.py`'s; apart so the daemon does not import the measuring machinery.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from numad_infer.util.atomicfile import write_atomic

RESULTS_NAME = "bandwidth.json"  # beside the state file: `numa-infer tune` writes it, the daemon reads it


def save(path: Path, medians: dict[tuple[int, int], float]) -> None:
    """Merged into what an earlier run measured (tune measures the nodes it is asked for)."""
    try:
        earlier = {(int(r["cpus_node"]), int(r["memory_node"])): float(r["gbs"])
                   for r in json.loads(path.read_text())["bandwidth"]}
    except (OSError, ValueError, KeyError, TypeError):
        earlier = {}
    medians = {**earlier, **medians}
    rows = [{"cpus_node": c, "memory_node": m, "gbs": round(v, 3)} for (c, m), v in sorted(medians.items())]
    write_atomic(path, json.dumps({"measured_at": time.time(), "bandwidth": rows}, indent=1))


class Results:
    """The local read bandwidth of each node as tune last measured it (re-read when the file changes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: float | None = None
        self._local: dict[int, float] = {}

    def local_gbs(self, node: int) -> float | None:
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            self._seen, self._local = None, {}
            return None
        if mtime != self._seen:
            self._seen, self._local = mtime, {}
            try:
                for row in json.loads(self.path.read_text())["bandwidth"]:
                    if row["cpus_node"] == row["memory_node"]:
                        self._local[int(row["cpus_node"])] = float(row["gbs"])
            except (OSError, ValueError, KeyError, TypeError):
                self._local = {}
        return self._local.get(node)
