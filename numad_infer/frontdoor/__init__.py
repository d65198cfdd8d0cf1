"""HAProxy in front of the instances: its config, binary, runtime API, listening socket.

numad_infer/layers.py lists its modules, their layers and jobs, and where it stands in
the import order."""
