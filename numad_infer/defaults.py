"""Default locations. Kept apart so light commands (status) need not import the config schema."""

DEFAULT_CONFIG_PATH = "/etc/numa-infer.toml"
DEFAULT_STATE_FILE = "/run/numa-infer/state.json"
