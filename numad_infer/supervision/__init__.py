"""One reconcile pass: health, drift checks, restarts, roll-outs.

numad_infer/layers.py lists its modules, their layers and jobs, and where it stands in
the import order."""
