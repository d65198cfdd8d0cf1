"""`doctor`'s plan needs with several models ([[models]]) on a captured machine (hwloc's
32em64t-2n8c: 2 nodes of 8 cores and 16 GiB each): each node's need is the sum over both
models' instances there, doctor judges each node's free memory against it, and a node too
small for them is refused by the plan, naming the node, the models, the bytes and each
model's own keys to change.

The models are GGUF files whose tensor table says 9 GiB and 3 GiB of F32 weights, sparse on
disk: the estimate counts the table, and the file is as long as the table says."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from numad_infer.doctor.pipeline import checkup, plan_needs
from numad_infer.errors import ConfigError
from numad_infer.host.identity import BackendKind
from numad_infer.validate.pipeline import load
from tests.conftest import CAPTURES, searchable_by_others
from tests.model import raw

CAPTURE = "32em64t-2n8c+dax+nvme+mic+dimms"
GiB = 1 << 30
F32 = 0


def sparse_model(path: Path, weight_bytes: int) -> None:
    """A GGUF file with one F32 tensor of `weight_bytes`, its data a hole."""
    header = raw.gguf(tensors=[raw.tensor("w", (weight_bytes // 4,), F32, 0)])
    path.write_bytes(header)
    with path.open("r+b") as handle:
        handle.truncate(len(header) + weight_bytes)
    path.chmod(0o644)


def machine(tmp_path: Path) -> Path:
    subprocess.run(["tar", "xjf", str(CAPTURES / f"{CAPTURE}.tar.bz2"), "-C", str(tmp_path)], check=True)
    (root,) = [p for p in tmp_path.iterdir() if p.name.startswith("32em64t")]
    return root


def set_meminfo(root: Path, node: int, key: str, kib: int) -> None:
    path = root / f"sys/devices/system/node/node{node}/meminfo"
    path.write_text(re.sub(rf"(Node {node} {key}:\s*)\d+", rf"\g<1>{kib}", path.read_text()))


@pytest.fixture
def two_models(tmp_path: Path) -> tuple[Path, Path]:
    from tests.daemon_harness import llama_server_binary

    home = searchable_by_others(tmp_path)
    sparse_model(home / "chat.gguf", 9 * GiB)
    sparse_model(home / "small.gguf", 3 * GiB)
    config = tmp_path / "numa-infer.toml"
    config.write_text(f'[server]\nllama_server = "{llama_server_binary()}"\n[frontend]\nlisten = ""\n'
                      f'[[models]]\nname = "chat"\npath = "{home / "chat.gguf"}"\ncores_per_instance = 6\n'
                      f'[[models]]\nname = "small"\npath = "{home / "small.gguf"}"\ncores_per_instance = 2\n')
    (tmp_path / "fs").mkdir()
    return config, machine(tmp_path / "fs")


def test_each_nodes_need_sums_both_models_and_doctor_judges_it_per_node(two_models: tuple[Path, Path]) -> None:
    config, root = two_models
    loaded = load(str(config), BackendKind.PROCESS, str(root))
    chat, small = (loaded.memory_of(name).bytes for name in ("chat", "small"))
    assert chat > 9 * GiB and small > 3 * GiB  # the weights, and the KV cache and the engine's overhead
    needs = plan_needs(loaded)
    assert needs.need_bytes == {0: chat + small, 1: chat + small}
    assert needs.per_instance.startswith("chat: ") and "; small: " in needs.per_instance
    assert needs.context_keys == "models[0].context_size or models[1].context_size"
    # Node 1 with 6 GiB free: doctor fails it (node 0, 15 GiB free in the capture, is fine).
    set_meminfo(root, 1, "MemFree", 6 * 1024 * 1024)
    set_meminfo(root, 1, "FilePages", 1024)
    checks = {c.name: c for c in checkup(loaded, root, None, 0.0, sampler=lambda seconds: ())}
    assert checks["memory on node 0"].level.name == "OK"
    node1 = checks["memory on node 1"]
    assert node1.level.name == "FAIL" and node1.wanted.startswith(f">= {(chat + small) / GiB:.1f} GiB for ")
    assert "per instance chat: " in node1.wanted
    assert "models[0].context_size or models[1].context_size" in node1.fix


def test_a_node_too_small_for_both_models_is_refused_naming_node_models_bytes_and_their_keys(
        two_models: tuple[Path, Path]) -> None:
    config, root = two_models
    set_meminfo(root, 1, "MemTotal", 12 * 1024 * 1024)  # 12 GiB: 10.8 GiB for the instances
    with pytest.raises(ConfigError) as refused:
        load(str(config), BackendKind.PROCESS, str(root))
    message = str(refused.value)
    available = int(12 * GiB * 0.9)
    assert message.startswith(f"{config}: node 1's memory cannot hold its instances: infer@chat-1, infer@small-1 "
                              "(chat, small) need ")
    assert f"the node has 10.8 GiB for them ({available} bytes: 12.0 GiB less a 10% reserve)" in message
    need = int(re.search(r"need [\d.]+ GiB \((\d+) bytes\)", message)[1])
    assert need > 12 * GiB
    assert message.endswith("use a smaller models[0].context_size or models[0].parallel, a smaller "
                            "models[1].context_size or models[1].parallel, a smaller quantisation of one of the "
                            "models or fewer models on node 1 (leave it out of models[0].nodes or models[1].nodes)")
    assert "interleave" not in message and "placement." not in message
