"""The model file: readable, GGUF, its header.

numad_infer/layers.py lists its modules, their layers and jobs, and where it stands in
the import order."""
