"""What the validation tests share: a small GGUF model with a real header, a stand-in
llama-server, and a two-node machine with little memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from numad_infer.topology.model import Topology
from numad_infer.topology.sysfs import read_topology
from tests import fakesys
from tests.conftest import searchable_by_others

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")


@pytest.fixture
def host(tmp_path: Path) -> tuple[Path, Path]:
    """A model with Llama 3 8B's attention (32 layers, 8 of 32 heads for K and V: 128 KiB of
    f16 KV cache a token) and a few small tensors; a stand-in llama-server."""
    searchable_by_others(tmp_path)
    model = tmp_path / "llama3ish.gguf"
    w = gguf.GGUFWriter(model, "llama")
    for key, value in (("block_count", 32), ("embedding_length", 4096), ("attention.head_count", 32),
                       ("attention.head_count_kv", 8), ("feed_forward_length", 14336)):
        w.add_uint32(f"llama.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((256, 4096), dtype=np.float16))  # 2 MiB, vocab 256
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.chmod(0o644)
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\ncase \"$1\" in\n--version) echo 'version: 1 (fake)' ;;\n"
                      "--help) echo '--api-key-file' ;;\n*) exit 0 ;;\nesac\n")
    server.chmod(0o755)
    return model, server


def small_nodes(tmp_path: Path, gib: int) -> Topology:
    machine = fakesys.FakeMachine(
        nodes={0: fakesys.FakeNode((0, 1), gib * fakesys.GiB_KB, (10, 20)),
               1: fakesys.FakeNode((2, 3), gib * fakesys.GiB_KB, (20, 10))},
        siblings=((0,), (1,), (2,), (3,)), l3=((0, 1), (2, 3)), offline=())
    return read_topology(fakesys.write_tree(tmp_path / "fs", machine))


