"""tune's one error: a measurement that could not be made (every tune module raises it)."""

from __future__ import annotations

from numad_infer.errors import NumaInferError


class TuneError(NumaInferError):
    """A measurement that could not be made; `cli.commands.cmd_tune` says so as `numa-infer tune: ...`."""
