"""CPU and node lists in the kernel's two spellings: "0-3,8" lists and hex masks."""

from __future__ import annotations

from collections.abc import Iterable


class CpuListError(ValueError):
    """A CPU/node list or mask that cannot be parsed."""


# Linux numbers CPUs below CONFIG_NR_CPUS, at most 8192 (MAXSMP); nodes stay far below.
# A bigger number is a typo, and "0-4294967295" would otherwise build a set of 4 billion.
MAX_CPUS = 8192


def parse_list(text: str) -> frozenset[int]:
    """Parse a kernel list such as "0-3,8,10-11" (the `cpulist` format); "" is empty."""
    result: set[int] = set()
    text = text.strip()
    if not text:
        return frozenset()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise CpuListError(f"empty element in list {text!r}")
        # Newer kernels accept "0-15:2" (stride); sysfs never writes it but operators may.
        stride = 1
        if ":" in part:
            part, _, stride_text = part.partition(":")
            if not (stride_text.isascii() and stride_text.isdigit()) or int(stride_text) == 0:
                raise CpuListError(f"bad stride in {text!r}")
            stride = int(stride_text)
        lo_text, dash, hi_text = part.partition("-")
        if not _number(lo_text) or (dash and not _number(hi_text)):
            raise CpuListError(f"{part!r} in {text!r} is not a number or a range a-b")
        lo = int(lo_text)
        hi = int(hi_text) if dash else lo
        if hi >= MAX_CPUS:
            raise CpuListError(f"{hi} in {text!r} is not a CPU or node number: Linux has fewer than {MAX_CPUS}")
        if hi < lo:
            raise CpuListError(f"range {part!r} in {text!r} runs backwards")
        result.update(range(lo, hi + 1, stride))
    return frozenset(result)


def _number(text: str) -> bool:
    # isdigit() alone also accepts "²" and other digits int() refuses.
    return text.isascii() and text.isdigit()


def parse_mask(text: str) -> frozenset[int]:
    """Parse a kernel hex mask such as "00000000,0000ff0f" (the `cpumap` format)."""
    digits = text.strip().replace(",", "")
    if digits.startswith(("0x", "0X")):
        digits = digits[2:]
    if not digits:
        return frozenset()
    try:
        value = int(digits, 16)
    except ValueError as exc:
        raise CpuListError(f"{text.strip()!r} is not a hex mask") from exc
    return frozenset(i for i in range(value.bit_length()) if value >> i & 1)


def format_list(items: Iterable[int]) -> str:
    """Format as the kernel does: sorted, consecutive runs as a-b, e.g. "0-3,8"."""
    ordered = sorted(set(items))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)
