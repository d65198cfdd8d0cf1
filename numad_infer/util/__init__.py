"""Small pure helpers every package uses: CPU lists, tables, typed JSON, addresses, atomic files.

numad_infer/layers.py lists its modules, their layers and jobs, and where it stands in
the import order."""
