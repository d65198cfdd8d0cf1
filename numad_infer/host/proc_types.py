"""What the monitor reads of a running process, as plain types: its threads and its memory
per node. `procfs` fills them in (the edge that reads the kernel), `drift` judges them
(pure); apart from both so the pure side imports no reader.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ThreadInfo:
    tid: int
    name: str
    allowed: frozenset[int]
    last_cpu: int | None


@dataclass
class NodeUsage:
    """Bytes per node, anonymous memory (the instance's own: weights, KV cache) apart from file pages."""

    anon: dict[int, int] = field(default_factory=dict)
    file: dict[int, int] = field(default_factory=dict)
    source: str = ""

    def add(self, kind: str, node: int, nbytes: int) -> None:
        target = self.anon if kind == "anon" else self.file
        target[node] = target.get(node, 0) + nbytes
