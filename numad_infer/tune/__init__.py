"""`numa-infer tune`: measure layouts, choose one, apply it.

numad_infer/layers.py lists its modules, their layers and jobs, and where it stands in
the import order."""
