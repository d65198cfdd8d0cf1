"""Errors an operator sees: each carries a message that says what to do, never a traceback."""


class NumaInferError(Exception):
    """Base of every error the CLI turns into `numa-infer: <message>` and exit status 1."""


class TopologyError(NumaInferError):
    """The sysfs tree cannot be understood as a NUMA machine."""


class ConfigError(NumaInferError):
    """The configuration file is invalid for this machine."""

