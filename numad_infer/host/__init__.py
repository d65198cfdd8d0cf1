"""The running host: /proc, CPU features, pinning syscalls, users, port owners.

numad_infer/layers.py lists its modules, their layers and jobs, and where it stands in
the import order."""
