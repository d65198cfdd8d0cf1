"""The model file: readable, GGUF, its header; what an instance of it holds in memory.

numad_infer/layers.py lists its modules, their layers and jobs, and where it stands in
the import order."""
