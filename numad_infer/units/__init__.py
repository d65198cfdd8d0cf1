"""The plan rendered as systemd unit text: the instances' template and drop-ins, and the front
door's unit.

numad_infer/layers.py lists its modules, their layers and jobs, and where it stands in
the import order."""
