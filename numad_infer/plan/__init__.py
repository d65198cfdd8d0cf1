"""Config + topology -> the plan: instances, cores, memory policy, ports.

numad_infer/layers.py lists its modules, their layers and jobs, and where it stands in
the import order."""
