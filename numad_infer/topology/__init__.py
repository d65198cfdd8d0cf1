"""The machine's NUMA topology and the part of it the cgroup allows (sysfs, cgroups).

numad_infer/layers.py lists its modules, their layers and jobs, and where it stands in
the import order."""
