"""numa-infer: one pinned llama.cpp server per NUMA node, rendered as systemd units."""

__version__ = "0.1.0"
