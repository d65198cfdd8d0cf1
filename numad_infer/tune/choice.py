"""`numa-infer tune`, the pure part: which settings to try, how repeated measurements
are summarised, which candidate wins and whether its margin is more than noise, and the
report. The measuring itself (servers, bandwidth) is `numad_infer.tune.measure`, holding
the fleet `numad_infer.tune.fleet`.

Decode (generation) is memory-bound and prompt processing compute-bound, so the two
thread counts are chosen apart: `placement.threads` by decode tokens/s, and
`placement.threads_batch` by prompt tokens/s.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from numad_infer.util.printable import printable_lines
from numad_infer.util.tables import format_table


@dataclass(frozen=True)
class Figure:
    """One quantity measured several times."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """Half the range, relative to the median: the noise a margin must beat."""
        if len(self.samples) < 2 or self.median <= 0:
            return 0.0
        return (max(self.samples) - min(self.samples)) / 2 / self.median

    def __str__(self) -> str:
        return f"{self.median:.1f} ±{self.spread:.0%}"


@dataclass(frozen=True)
class Candidate:
    threads: int
    label: str  # why it is in the grid: "physical cores", "SMT siblings", "cores - 1", ...


@dataclass(frozen=True)
class Result:
    candidate: Candidate
    decode: Figure  # tokens/s generating, one client
    prompt: Figure  # tokens/s processing a prompt

    def efficiency(self, decode_bytes: int, bandwidth_gbs: float | None) -> float | None:
        """Decode tokens/s x bytes a decoded token reads (model/gguf.py) / the node's read bandwidth."""
        if not bandwidth_gbs:
            return None
        return self.decode.median * decode_bytes / (bandwidth_gbs * 1e9)


def thread_grid(cores: int, logical: int, quick: bool = False) -> list[Candidate]:
    """Thread counts to try on a node with `cores` physical cores and `logical` CPUs: the
    physical cores (today's rule), every logical CPU (SMT on), and a few below, since one
    thread too many costs more than one too few on some machines."""
    found: dict[int, str] = {}

    def add(count: int, label: str) -> None:
        if 1 <= count <= logical and count not in found:
            found[count] = label

    add(cores, "physical cores")
    if logical > cores:
        add(logical, "SMT siblings too")
    add(cores - 1, "cores - 1")
    if not quick:
        add(cores * 3 // 4, "3/4 of the cores")
        add(cores // 2, "half the cores")
        add(cores - 2, "cores - 2")
    return [Candidate(n, found[n]) for n in sorted(found, reverse=True)]


class Verdict(str, Enum):
    CHANGE = "change"  # the winner beats the current setting by more than the noise
    KEEP = "keep"  # within noise, or the current setting is the best


@dataclass(frozen=True)
class Choice:
    key: str  # the configuration key this choice is for
    metric: str  # "decode" or "prompt"
    current: int
    winner: int
    margin: float  # winner over current, relative (0.12 = 12 % faster)
    noise: float  # the larger spread of the two
    verdict: Verdict

    @property
    def value(self) -> int:
        """What the key should say: the winner only when it is really faster."""
        return self.winner if self.verdict == Verdict.CHANGE else self.current


def choose(results: list[Result], key: str, metric: str, current: int) -> Choice:
    """The best measured candidate by `metric`, against the one matching `current`."""
    def rate(result: Result) -> Figure:
        return result.decode if metric == "decode" else result.prompt

    by_threads = {r.candidate.threads: r for r in results}
    if current not in by_threads:
        raise ValueError(f"the current setting ({current} threads) was not measured")
    best = max(results, key=lambda r: rate(r).median)
    base = by_threads[current]
    margin = rate(best).median / rate(base).median - 1 if rate(base).median > 0 else float("inf")
    noise = max(rate(best).spread, rate(base).spread)
    verdict = Verdict.CHANGE if best.candidate.threads != current and margin > noise else Verdict.KEEP
    return Choice(key, metric, current, best.candidate.threads, margin, noise, verdict)


@dataclass
class Report:
    model: str
    weight_bytes: int  # the file
    decode_bytes: int  # what one decoded token reads of it (gguf.GgufHeader.decode_bytes)
    engine: str
    node: int
    cpus: tuple[int, ...]
    bandwidth: dict[tuple[int, int], Figure] = field(default_factory=dict)  # (cpu node, memory node) -> GB/s
    results: list[Result] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)
    layout_results: list[LayoutResult] = field(default_factory=list)
    current_layout: Layout | None = None
    engine_cpu: str | None = None  # the CPU kernels the engine ran (cpufeatures.EngineCpu.describe)

    def to_json(self) -> dict[str, Any]:
        def figure(f: Figure) -> dict[str, Any]:
            return {"median": round(f.median, 3), "spread": round(f.spread, 4),
                    "samples": [round(s, 3) for s in f.samples]}

        local = self.bandwidth.get((self.node, self.node))
        return {
            "model": self.model, "weight_bytes": self.weight_bytes, "decode_bytes": self.decode_bytes,
            "engine": self.engine, "engine_cpu": self.engine_cpu, "node": self.node,
            "cpus": list(self.cpus),
            "bandwidth_gbs": [{"cpus_node": c, "memory_node": m, **figure(f)}
                              for (c, m), f in sorted(self.bandwidth.items())],
            "candidates": [{"threads": r.candidate.threads, "label": r.candidate.label,
                            "decode_tokens_per_s": figure(r.decode),
                            "prompt_tokens_per_s": figure(r.prompt),
                            "decode_efficiency": _round(r.efficiency(self.decode_bytes,
                                                                     local.median if local else None))}
                           for r in self.results],
            "choices": [{**asdict(c), "verdict": c.verdict.value, "value": c.value} for c in self.choices],
            "layouts": [{"mode": r.layout.mode, "instances_per_node": r.layout.instances_per_node,
                         "name": r.layout.name,
                         "instances": r.instances, "clients": r.clients, "aggregate_tokens_per_s": figure(r.aggregate),
                         "p50_s": round(r.p50_s, 3), "p99_s": round(r.p99_s, 3),
                         "current": r.layout == self.current_layout} for r in self.layout_results],
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def format_report(report: Report) -> str:
    lines = [f"model {report.model} ({report.weight_bytes / 2**20:.0f} MiB, {report.decode_bytes / 2**20:.0f} MiB read "
             f"per decoded token), engine {report.engine}"
             f"{f' ({report.engine_cpu})' if report.engine_cpu else ''}, "
             f"node {report.node} (CPUs {','.join(map(str, report.cpus))})"]
    if report.bandwidth:
        nodes = sorted({m for _, m in report.bandwidth})
        lines.append("memory read bandwidth, GB/s (rows: CPUs of node, columns: memory of node):")
        lines.append("node " + "".join(f"{m:>12}" for m in nodes))
        for cn in sorted({c for c, _ in report.bandwidth}):
            lines.append(f"{cn:>4} " + "".join(
                f"{str(report.bandwidth[cn, m]) if (cn, m) in report.bandwidth else '-':>12}" for m in nodes))
    local = report.bandwidth.get((report.node, report.node))
    marks = {c.metric: c for c in report.choices}
    rows = [("THREADS", "WHY", "DECODE tok/s", "PROMPT tok/s", "DECODE EFF", "")]
    for r in report.results:
        eff = r.efficiency(report.decode_bytes, local.median if local else None)
        notes = []
        for metric, choice in marks.items():
            if r.candidate.threads == choice.current:
                notes.append(f"current {choice.key.split('.')[-1]}")
            if r.candidate.threads == choice.winner:
                notes.append(f"best {metric}")
        rows.append((str(r.candidate.threads), r.candidate.label, str(r.decode), str(r.prompt),
                     "-" if eff is None else f"{eff:.0%}", ", ".join(notes)))
    lines += format_table(rows)
    for c in report.choices:
        if c.verdict == Verdict.CHANGE:
            lines.append(f"{c.key} = {c.winner}: {c.margin:+.1%} {c.metric} tokens/s over the current {c.current} "
                         f"(noise ±{c.noise:.1%})")
        elif c.winner == c.current:
            lines.append(f"{c.key}: the current {c.current} is the fastest measured; keep it")
        else:
            lines.append(f"{c.key}: {c.winner} measured {c.margin:+.1%} over the current {c.current}, within the "
                         f"noise (±{c.noise:.1%}); keep the current setting")
    # Escaped: the engine's CPU line is what the engine printed.
    text = printable_lines(lines)
    if report.layout_results and report.current_layout is not None:
        text += "\n" + format_layouts(report.layout_results, report.current_layout)
    return text


# -- layouts under concurrency -------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    mode: str  # placement.mode
    instances_per_node: int
    label: str

    @property
    def name(self) -> str:
        return "interleave" if self.mode == "interleave" else f"per-node x{self.instances_per_node}"


@dataclass(frozen=True)
class LayoutResult:
    layout: Layout
    instances: int
    clients: int
    aggregate: Figure  # tokens/s over all clients
    p50_s: float  # request latency
    p99_s: float


def layouts(l3_per_node: int, cores_per_node: int) -> list[Layout]:
    """One instance per node (today's default), k per node along the shared L3 caches
    (or 2 when a node has one L3 and enough cores), and one interleaved over every node."""
    found = [Layout("per-node", 1, "one per node")]
    k = l3_per_node if l3_per_node > 1 else (2 if cores_per_node >= 4 else 1)
    if k > 1:
        found.append(Layout("per-node", k, "one per shared L3" if l3_per_node > 1 else "two per node"))
    found.append(Layout("interleave", 1, "one over all nodes"))
    return found


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def choose_layout(results: list[LayoutResult], current: Layout) -> tuple[LayoutResult, float, float, Verdict]:
    """(winner, margin over the current layout, noise, verdict), by aggregate tokens/s."""
    best = max(results, key=lambda r: r.aggregate.median)
    base = next(r for r in results if r.layout == current)
    margin = best.aggregate.median / base.aggregate.median - 1 if base.aggregate.median > 0 else float("inf")
    noise = max(best.aggregate.spread, base.aggregate.spread)
    verdict = Verdict.CHANGE if best.layout != current and margin > noise else Verdict.KEEP
    return best, margin, noise, verdict


def format_layouts(results: list[LayoutResult], current: Layout) -> str:
    best, margin, noise, verdict = choose_layout(results, current)
    rows = [("LAYOUT", "INSTANCES", "CLIENTS", "AGGREGATE tok/s", "P50 s", "P99 s", "")]
    for r in results:
        note = ", ".join(n for n, on in (("current", r.layout == current), ("best", r is best)) if on)
        rows.append((r.layout.name, str(r.instances), str(r.clients), str(r.aggregate), f"{r.p50_s:.2f}",
                     f"{r.p99_s:.2f}", note))
    lines = format_table(rows)
    if verdict == Verdict.CHANGE:
        lines.append(f"layout {best.layout.name}: {margin:+.1%} aggregate tokens/s over the current {current.name} "
                     f"(noise ±{noise:.1%})")
    elif best.layout == current:
        lines.append(f"layout: the current {current.name} is the fastest measured; keep it")
    else:
        lines.append(f"layout: {best.layout.name} measured {margin:+.1%} over the current {current.name}, within the "
                     f"noise (±{noise:.1%}); keep the current layout")
    return printable_lines(lines)
