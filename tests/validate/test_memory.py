"""The validation pipeline sizes one instance from the model's header and the engine's
command line (weights, KV cache, overhead), and refuses a plan whose instances do not fit
in a node's memory: one line naming the node, the model, the bytes and what to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from numad_infer.config.load import parse_config
from numad_infer.engines.llama_server import OVERHEAD
from numad_infer.errors import ConfigError
from numad_infer.host.identity import BackendKind
from numad_infer.topology.sysfs import read_topology
from numad_infer.validate.pipeline import validate
from tests.validate.conftest import small_nodes

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")
MiB = 1 << 20
SOURCE = "/etc/numa-infer.toml"


def config(model: Path, server: Path, context: int, parallel: int, extra: str = ""):
    return parse_config(f'[model]\npath = "{model}"\ncontext_size = {context}\n[server]\nllama_server = "{server}"\n'
                        f'parallel = {parallel}\n{extra}[frontend]\nlisten = ""\n', SOURCE)


def test_an_instance_is_sized_from_the_header_and_the_engines_context(tmp_path: Path, host) -> None:
    model, server = host
    loaded = validate(config(model, server, 2048, 2), SOURCE, small_nodes(tmp_path, 4), BackendKind.PROCESS,
                      unit_dirs=())
    (one,) = loaded.models
    m = one.memory
    assert m.weights == 256 * 4096 * 2
    assert m.kv_cache == 2048 * 2 * 128 * 1024  # context_size x parallel cells, 128 KiB each
    # llama-server's: its runtime + 240 B x 256 vocabulary entries + 512 x (16 B x n_embd 4096
    # + 12 B x n_ff 14336 + 2 B x 2048 per slot).
    assert m.overhead == OVERHEAD.runtime + 240 * 256 + 512 * (16 * 4096 + 12 * 14336 + 2 * 2048)
    assert loaded.memory_of("").bytes == m.total and loaded.memory_of("").model == "llama3ish.gguf"


def test_instances_that_do_not_fit_a_node_are_refused_naming_node_bytes_and_fix(tmp_path: Path, host) -> None:
    model, server = host
    # 8192 x 4 cells = 4 GiB of KV cache per instance (and 28 MiB + 240 x 256 + 512 x (16 x 4096 +
    # 12 x 14336 + 2 x 8192) B of overhead); a 4 GiB node has 3.6 GiB for its instances.
    with pytest.raises(ConfigError) as refused:
        validate(config(model, server, 8192, 4), SOURCE, small_nodes(tmp_path, 4), BackendKind.PROCESS, unit_dirs=())
    message = str(refused.value)
    assert message.startswith(f"{SOURCE}: node 0's memory cannot hold its instances: infer@0 (llama3ish.gguf) need "
                              "4.2 GiB (4456509440 bytes), the node has 3.6 GiB for them (3865470566 bytes: 4.0 GiB "
                              "less a 10% reserve); per instance llama3ish.gguf: weights 2 MiB + KV cache 4.0 GiB + "
                              "overhead 152 MiB = 4.2 GiB, and a prompt cache sized to its node (per instance); use a smaller "
                              'model.context_size or server.parallel, a smaller quantisation of the model or placement.mode = "interleave" (one instance, its memory spread '
                              "over every node)")
    assert "\n" not in message
    # A q8_0 cache (34 bytes per 32 values, not 64) halves it: then it fits.
    fitted = validate(config(model, server, 8192, 4, 'extra_args = ["-ctk", "q8_0", "-ctv", "q8_0"]\n'), SOURCE,
                      small_nodes(tmp_path / "again", 4), BackendKind.PROCESS, unit_dirs=())
    assert fitted.models[0].memory.kv_cache == 8192 * 4 * 32 * 2 * 1024 // 32 * 34
    # It fits once loaded; llama-server's prompt cache (8 GiB unless bounded) is sized to what
    # the node has left: 3.6 GiB less the 2.3 GiB need, less a quarter: no warning.
    assert not [w for w in fitted.warnings if "prompt cache" in w]
    (instance,) = (i for i in fitted.plan.instances if i.name == "infer@0")
    left = 3865470566 - fitted.models[0].memory.total
    assert instance.prompt_cache_mib == int(left * 0.75) >> 20
    assert fitted.launches["infer@0"].argv[-2:] == ("--cache-ram", str(instance.prompt_cache_mib))
    # The operator's own bound is kept, and warned on when the node cannot hold it.
    own = validate(config(model, server, 8192, 4, 'extra_args = ["-ctk", "q8_0", "-ctv", "q8_0", "-cram", "8192"]\n'),
                   SOURCE, small_nodes(tmp_path / "own", 4), BackendKind.PROCESS, unit_dirs=())
    assert own.plan.instances[0].prompt_cache_mib is None and own.launches["infer@0"].argv.count("-cram") == 1
    assert "--cache-ram" not in own.launches["infer@0"].argv
    grows = [w for w in own.warnings if "prompt caches" in w]
    assert len(grows) == 2 and grows[0].startswith("node 0: its instances (infer@0) need 2.3 GiB once loaded, which "
                                                   "fits, but can grow by up to 8.0 GiB more with use")
    assert grows[0].endswith('bound it with server.extra_args = [..., "--cache-ram", "MIB"]')
    # Bounded to 1 GiB (2.3 + 1 < 3.6 GiB): no warning, and the operator's value is the one passed.
    bounded = validate(config(model, server, 8192, 4, 'extra_args = ["-ctk", "q8_0", "-ctv", "q8_0", "--cache-ram", '
                              '"1024"]\n'), SOURCE, small_nodes(tmp_path / "bounded", 4), BackendKind.PROCESS,
                       unit_dirs=())
    assert bounded.launches["infer@0"].argv[-2:] == ("--cache-ram", "1024")
    assert bounded.launches["infer@0"].argv.count("--cache-ram") == 1
    assert not [w for w in bounded.warnings if "prompt cache" in w]


def test_the_single_form_with_a_model_name_is_sized_as_one_without(tmp_path: Path, host: tuple[Path, Path]) -> None:
    """`model.name` (what clients send; the shipped example and scripts/demo set it) names no
    unit: the instances carry no model (Instance.model == ""), and the memory check finds
    their need all the same, as the planner looks it up."""
    model, server = host
    named = validate(config(model, server, 512, 1), SOURCE, small_nodes(tmp_path / "a", 4), BackendKind.PROCESS,
                     unit_dirs=())
    with_name = parse_config(f'[model]\npath = "{model}"\nname = "llama3"\ncontext_size = 512\n[server]\n'
                             f'llama_server = "{server}"\n[frontend]\nlisten = ""\n', SOURCE)
    loaded = validate(with_name, SOURCE, small_nodes(tmp_path / "b", 4), BackendKind.PROCESS, unit_dirs=())
    assert [i.name for i in loaded.plan.instances] == ["infer@0", "infer@1"]
    assert [f.need for f in loaded.fits()] == [f.need for f in named.fits()]
    assert loaded.memory_of("").detail == named.memory_of("").detail
