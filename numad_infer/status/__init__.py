"""What the daemon publishes: status records, the state file, Prometheus metrics.

numad_infer/layers.py lists its modules, their layers and jobs, and where it stands in
the import order."""
