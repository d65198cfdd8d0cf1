"""The model file as the planner needs it: present, readable, GGUF, and how big."""

from __future__ import annotations

import os

from numad_infer.config import ConfigError

GGUF_MAGIC = b"GGUF"


def model_size(path: str, source: str) -> int:
    """Size in bytes of a readable GGUF file, or a ConfigError on `model.path`."""
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
            size = os.fstat(handle.fileno()).st_size
    except FileNotFoundError:
        raise ConfigError(source, "model.path", "file not found; put a GGUF model there or fix the path", path, True) from None
    except PermissionError:
        raise ConfigError(
            source, "model.path", "cannot be read by this user; fix its permissions (chmod 644) ", path, True
        ) from None
    except IsADirectoryError:
        raise ConfigError(source, "model.path", "is a directory; name the .gguf file itself", path, True) from None
    except OSError as exc:
        raise ConfigError(source, "model.path", f"cannot be read: {exc.strerror}", path, True) from None
    if magic != GGUF_MAGIC:
        raise ConfigError(source, "model.path", "is not a GGUF model file (llama.cpp loads only GGUF)", path, True)
    return size
