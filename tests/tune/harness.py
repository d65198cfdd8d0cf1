"""What tune's tests share: a configuration `check` accepts on the fake 2-node machine."""

from __future__ import annotations

from pathlib import Path

from tests import fakesys
from tests.conftest import searchable_by_others
from tests.daemon_harness import llama_server_binary


def checked_setup(tmp_path: Path) -> tuple[Path, Path]:
    """A configuration `check` accepts on the fake 2-node machine (no front door)."""
    model = searchable_by_others(tmp_path) / "m.gguf"
    model.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(4088))  # version 3, no tensors, no metadata
    model.chmod(0o644)
    path = tmp_path / "numa-infer.toml"
    # No engine named: the default, llama-server, this tree's build of it.
    path.write_text(f'# kept\n[model]\npath = "{model}"\n\n[server]\nllama_server = "{llama_server_binary()}"\n\n'
                    '[frontend]\nlisten = ""\n')
    return path, fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt())
