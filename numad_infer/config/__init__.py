"""The TOML file: its schema, defaults, key reference and the API key file it names.

numad_infer/layers.py lists its modules, their layers and jobs, and where it stands in
the import order."""
