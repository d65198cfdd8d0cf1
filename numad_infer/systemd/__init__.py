"""Systemd's interfaces: sd_notify, systemctl, unit names, the unit directory.

numad_infer/layers.py lists its modules, their layers and jobs, and where it stands in
the import order."""
