"""etc/numa-infer.toml, what the package installs as /etc/numa-infer.toml: the everyday keys
only (at most 60 lines), the real loader takes it, every value is the schema's default but
the overrides `EVERYDAY` gives with their reasons, and the man page's [[models]] and
[[tenants]] examples work with it. That the file is what the generator writes is
tests/test_docs.py's check."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from numad_infer.config import example, load
from numad_infer.config.load import load_config, parse_config
from numad_infer.config.reference import keys, tables
from numad_infer.config.schema import Config
from numad_infer.config.tuning import TuningSection
from numad_infer.engines.keys import check_engine_keys
from numad_infer.errors import ConfigError
from tests.fakes import served_of

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_FILE = ROOT / example.PATH
SRC = "/etc/numa-infer.toml"


def _values(config: Config) -> dict[str, Any]:
    """`section.key` -> value, and `models[k].key` for each [[models]] table."""
    found: dict[str, Any] = {}
    for section, table in config.model_dump().items():
        if isinstance(table, list):
            found |= {f"{section}[{k}].{key}": value for k, entry in enumerate(table) for key, value in entry.items()}
        elif table is not None:
            found |= {f"{section}.{key}": value for key, value in table.items()}
    return found


def test_the_shipped_file_loads_with_the_real_loader() -> None:
    config = parse_config(SHIPPED_FILE.read_text(), SRC)
    check_engine_keys(config, SRC)  # the validation pipeline's engine check: no key of the other engine
    assert config.server.parallel == 4 and config.model is not None and config.model.name == "model"


def test_the_shipped_file_is_the_everyday_surface_at_most_60_lines() -> None:
    lines = SHIPPED_FILE.read_text().splitlines()
    assert len(lines) <= example.MAX_LINES == 60
    assert max(map(len, lines)) <= example.WIDTH
    # No [tuning] knob, no array of tables: those are the man page's.
    assert not set(example.EVERYDAY) & {f"tuning.{name}" for name in TuningSection.model_fields}
    assert "[tuning]" not in tomllib.loads(SHIPPED_FILE.read_text()) and 20 <= len(example.EVERYDAY) <= 30


def _shown() -> dict[str, tuple[str, bool, str]]:
    """`section.key` -> (its TOML value, commented out, its note) for each key line of the file."""
    found, section = {}, ""
    for line in SHIPPED_FILE.read_text().splitlines():
        if table := re.fullmatch(r"\[(\w+)\]", line):
            section = table[1]
        elif key := re.fullmatch(r"(# )?(\w+) = (.+?)  # (.+)", line):
            found[f"{section}.{key[2]}"] = (key[3], bool(key[1]), key[4])
    return found


def test_every_everyday_key_is_shown_once_in_schema_order_with_its_note() -> None:
    shown = _shown()
    order = [doc.key for doc in keys() if doc.key in example.EVERYDAY]
    assert list(shown) == order and set(order) == set(example.EVERYDAY)
    for key, (_, commented, note) in shown.items():
        entry = example.EVERYDAY[key]
        assert note.startswith(entry.note) and commented == entry.commented, key


def test_every_value_is_the_default_but_the_listed_overrides_and_each_says_why() -> None:
    defaults = {doc.key: doc.default for doc in keys()}
    for key, (value, _, note) in _shown().items():
        entry = example.EVERYDAY[key]
        assert value == (entry.value or defaults[key]), key
        overridden = entry.value is not None and defaults[key] is not None
        assert note.endswith(f"(default {defaults[key]})") == overridden, key
        assert (len(entry.why) > 20) == (entry.value is not None or entry.commented), key
    assert _shown()["server.parallel"][2].endswith("(default 1)")


def test_a_key_left_commented_out_is_unset_and_uncommented_takes_its_default() -> None:
    raw = tomllib.loads(SHIPPED_FILE.read_text())
    defaults = _values(parse_config('[model]\npath = "/m.gguf"\n', SRC))
    for key, (value, commented, _) in _shown().items():
        if commented:
            section, name = key.split(".")
            assert name not in raw[section], key
            uncommented = parse_config(f'[model]\npath = "/m.gguf"\n[{section}]\n{name} = {value}\n', SRC)
            assert _values(uncommented)[key] == defaults[key], key


def _switched(text: str) -> str:
    """The shipped file with [model] replaced by the man page's [[models]] example."""
    from numad_infer.config.reference import MODELS_EXAMPLE

    lines = text.splitlines()
    start = lines.index("[model]")
    end = next(k for k in range(start + 1, len(lines)) if not lines[k] or lines[k].startswith("["))
    return "\n".join(lines[:start] + MODELS_EXAMPLE.splitlines() + lines[end:]) + "\n"


def test_the_models_example_in_place_of_model_is_a_valid_file_and_plans_28_and_4_cores(tmp_path: Path) -> None:
    """What an operator does to switch: replace [model] with the man page's example. The
    shipped file leaves placement.nodes and instances_per_node unset, which [[models]] refuses."""
    from numad_infer.config.models import served_models
    from numad_infer.config.reference import MODELS_EXAMPLE
    from numad_infer.plan.placement import make_plan
    from numad_infer.topology.sysfs import read_topology
    from tests import fakesys

    config = parse_config(_switched(SHIPPED_FILE.read_text()), SRC)
    check_engine_keys(config, SRC)
    assert config.model is None
    assert [(m.name, m.aliases, m.cores_per_instance) for m in served_models(config)] == [
        ("llama-3.1-70b", ("gpt-4o",), 28), ("llama-3.1-8b", ("gpt-4o-mini",), 4)]
    # The machine the example describes: 2 sockets, 32 cores (64 CPUs with SMT) per node.
    topo = read_topology(fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt()))
    plan = make_plan(config, topo, source=SRC, served=served_of(config))
    cores = sorted((i.model, i.node, len(i.cpus)) for i in plan.instances)
    assert cores == [("llama-3.1-70b", 0, 28), ("llama-3.1-70b", 1, 28), ("llama-3.1-8b", 0, 4),
                     ("llama-3.1-8b", 1, 4)]
    for node in (0, 1):
        here = [set(i.cpus) for i in plan.instances if i.node == node]
        assert not here[0] & here[1]
    # The shipped file with the example added and [model] kept: refused in one line.
    both = SHIPPED_FILE.read_text() + "\n" + MODELS_EXAMPLE
    with pytest.raises(ConfigError, match=r"models: and \[model\] are both set"):
        parse_config(both, SRC)


def test_the_tenants_example_added_is_a_valid_file() -> None:
    from numad_infer.config.reference import TENANTS_EXAMPLE

    config = parse_config(SHIPPED_FILE.read_text() + "\n" + TENANTS_EXAMPLE, SRC)
    assert [(t.name, t.max_in_flight, t.requests_per_minute) for t in config.tenants] == [
        ("chat", None, None), ("batch", 4, 600)]


def test_a_required_key_without_a_shipped_value_stops_the_generator() -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(example.EVERYDAY, "model.path", example.Shown("the GGUF file"))
        with pytest.raises(ValueError, match=r"model\.path is required"):
            example.example_toml()


def test_the_file_a_missing_config_points_to_exists_here(tmp_path: Path) -> None:
    # A source tree (this one) has no /usr/share/doc/numa-infer: the hint names its own copy.
    with pytest.raises(ConfigError) as missing:
        load_config(ROOT / "no-such-dir" / "numa-infer.toml")
    named = re.search(r"copy (\S+)", str(missing.value))
    assert named is not None and Path(named[1]).is_file(), missing.value
    # The package's copy first, where it is installed; and none at all where neither exists.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(load, "_EXAMPLES", (tmp_path / "installed.toml", tmp_path / "tree.toml"))
        (tmp_path / "installed.toml").write_text("")
        assert f"copy {tmp_path / 'installed.toml'} there" in load._example_hint()
        (tmp_path / "installed.toml").unlink()
        assert "copy" not in load._example_hint() and "numa-infer.toml(5)" in load._example_hint()
    assert load._EXAMPLES[0] == Path("/usr/share/doc/numa-infer/examples/numa-infer.toml")
    # dh_installexamples puts each file debian/numa-infer.examples lists there; dh_install the conffile.
    assert example.PATH in (ROOT / "debian/numa-infer.examples").read_text().split()
    assert f"{example.PATH} etc/" in (ROOT / "debian/numa-infer.install").read_text().splitlines()
