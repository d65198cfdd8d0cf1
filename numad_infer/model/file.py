"""The model file as the planner needs it: present, readable, GGUF, and how big."""

from __future__ import annotations

import os
import stat

from numad_infer.errors import ConfigError
from numad_infer.host.identity import RunAs, unreadable_reason

GGUF_MAGIC = b"GGUF"


def model_size(path: str, source: str, runs_as: RunAs | None = None) -> int:
    """Size in bytes of a readable GGUF file, or a ConfigError on `model.path`.

    `runs_as`: the instances run as another user (identity.instances_run_as): check what
    that user can read, not what the daemon (root, as a rule) can.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(source, "model.path", "file not found; put a GGUF model there or fix the path",
                          path, True) from None
    except PermissionError:
        # A directory on the way this user may not search: a volume mounted with the wrong owner or mode.
        raise ConfigError(source, "model.path", f"cannot be reached: a directory on its path is not readable by uid "
                          f"{os.geteuid()}; make the model's volume readable by that user", path, True) from None
    except OSError as exc:
        raise ConfigError(source, "model.path", f"cannot be read: {exc.strerror}", path, True) from None
    if stat.S_ISDIR(mode):
        raise ConfigError(source, "model.path", "is a directory; name the .gguf file itself", path, True)
    if not stat.S_ISREG(mode):
        # A FIFO or a device would block the read below (or never end).
        raise ConfigError(source, "model.path", "is not a regular file; name the .gguf file itself", path, True)
    reason = unreadable_reason(path, runs_as) if runs_as is not None else None
    if reason is not None:
        raise ConfigError(source, "model.path", f"cannot be read by the instances: {reason}", path, True)
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
            size = os.fstat(handle.fileno()).st_size
    except FileNotFoundError:
        raise ConfigError(source, "model.path", "file not found; put a GGUF model there or fix the path",
                          path, True) from None
    except PermissionError:
        raise ConfigError(
            source, "model.path", f"cannot be read by this user; make it readable by uid {os.geteuid()} (chmod 644)",
            path, True
        ) from None
    except IsADirectoryError:
        raise ConfigError(source, "model.path", "is a directory; name the .gguf file itself", path, True) from None
    except OSError as exc:
        raise ConfigError(source, "model.path", f"cannot be read: {exc.strerror}", path, True) from None
    if magic != GGUF_MAGIC:
        raise ConfigError(source, "model.path", "is not a GGUF model file (llama.cpp loads only GGUF)", path, True)
    return size
