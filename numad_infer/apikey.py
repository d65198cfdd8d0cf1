"""`server.api_key_file`: the key the instances require, read by root only.

The key never reaches argv or a unit file: under systemd it is a credential
(LoadCredential=, see render.py), under the process backend the child's environment.
"""

from __future__ import annotations

import hashlib
import os
import stat

from numad_infer.config import Config
from numad_infer.errors import ConfigError


def read_api_key(config: Config, source: str) -> str | None:
    """The key, or None when none is configured; a ConfigError on `server.api_key_file` otherwise."""
    path = config.server.api_key_file
    if not path:
        return None

    def refuse(problem: str) -> ConfigError:
        return ConfigError(source, "server.api_key_file", problem, path, True)

    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise refuse("is not a regular file; put the key in a file")
        if info.st_mode & 0o077:
            raise refuse(f"can be read or written by others (mode {stat.S_IMODE(info.st_mode):04o}); "
                         f"chmod 600 {path}")
        with open(path, encoding="utf-8") as handle:
            key = handle.read().strip()
    except FileNotFoundError:
        raise refuse("file not found; write the key into it (umask 077; e.g. openssl rand -hex 32 > FILE)") from None
    except PermissionError:
        raise refuse("cannot be read by this user; run as root") from None
    except UnicodeDecodeError:
        raise refuse("is not UTF-8 text") from None
    except OSError as exc:
        raise refuse(f"cannot be read: {exc.strerror}") from None
    if not key or any(c.isspace() or not c.isprintable() for c in key):
        raise refuse("must hold one key: printable characters without spaces, on one line")
    return key


def fingerprint(key: str | None) -> str:
    """Stands for the key in what is compared or logged (a changed key restarts the instances)."""
    return "" if key is None else hashlib.sha256(key.encode()).hexdigest()[:16]
