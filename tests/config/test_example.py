"""etc/numa-infer.toml, what the package installs as /etc/numa-infer.toml: the real loader
takes it, every value is the schema's default but the overrides `SHIPPED` lists with their
reasons, and every comment is its key's (or table's) description. That the file is what the
generator writes is tests/test_docs.py's check."""

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
from numad_infer.engines.keys import check_engine_keys
from numad_infer.errors import ConfigError

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


def _array_block(table: str = "models") -> tuple[int, int]:
    """Where the commented-out [[table]] block lies: its first line and the line after it."""
    lines = SHIPPED_FILE.read_text().splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith(f"# [[{table}]]: "))
    end = next((k for k in range(start, len(lines)) if not lines[k].startswith("#")), len(lines))
    return start, end


ARRAYS = ("models", "tenants")


def _active_lines() -> list[str]:
    """The file without the [[models]] and [[tenants]] blocks: the single-[model] file it is."""
    lines = SHIPPED_FILE.read_text().splitlines()
    for start, end in sorted((_array_block(table) for table in ARRAYS), reverse=True):
        lines = lines[:start] + lines[end:]
    return lines


def _commented() -> dict[str, str]:
    """`section.key` -> the TOML value of each key the file shows commented out."""
    found, section = {}, ""
    for line in _active_lines():
        if table := re.fullmatch(r"\[(\w+)\]", line):
            section = table[1]
        elif key := re.fullmatch(r"# (\w+) = (.+)", line):
            found[f"{section}.{key[1]}"] = key[2]
    return found


def test_the_shipped_file_loads_and_every_value_is_the_default_but_the_listed_overrides() -> None:
    config = parse_config(SHIPPED_FILE.read_text(), SRC)
    check_engine_keys(config, SRC)  # the validation pipeline's engine check: no key of the other engine
    defaults = _values(parse_config('[model]\npath = "/m.gguf"\n', SRC))
    shipped = _values(config)
    differ = {key for key in defaults if shipped[key] != defaults[key]}
    overrides = {key for key, entry in example.SHIPPED.items() if entry.value is not None}
    assert differ == overrides
    raw = tomllib.loads(SHIPPED_FILE.read_text())
    for key in overrides:
        section, name = key.split(".")
        assert raw[section][name] == tomllib.loads(f"v = {example.SHIPPED[key].value}")["v"], key


def test_a_key_left_commented_out_is_unset_and_shows_its_default() -> None:
    commented = _commented()
    assert set(commented) == {key for key, entry in example.SHIPPED.items() if entry.commented}
    raw = tomllib.loads(SHIPPED_FILE.read_text())
    defaults = _values(parse_config('[model]\npath = "/m.gguf"\n', SRC))
    for key, value in commented.items():
        section, name = key.split(".")
        assert name not in raw[section], key
        # Uncommented alone (the schema's check only: python is refused beside llama-server).
        uncommented = parse_config(f'[model]\npath = "/m.gguf"\n[{section}]\n{name} = {value}\n', SRC)
        assert _values(uncommented)[key] == defaults[key], key


def test_every_override_names_a_key_and_says_why() -> None:
    every = {doc.key for doc in keys()}
    for key, entry in example.SHIPPED.items():
        assert key in every and len(entry.why) > 20, key
        assert (entry.value is None) == entry.commented, f"{key}: either another value or commented out"


def _blocks() -> list[tuple[str, str]]:
    """(what a comment block heads: `[table]` or a key, the block's text joined), in file order."""
    blocks, comment = [], []
    for line in _active_lines():
        if setting := re.fullmatch(r"(?:# )?(\w+) = .*", line):
            blocks.append((setting[1], " ".join(comment)))
            comment = []
        elif table := re.fullmatch(r"\[\w+\]", line):
            blocks.append((table[0], " ".join(comment)))
            comment = []
        elif line.startswith("# "):
            comment.append(line[2:])
        else:
            comment = []
    return blocks


def test_every_table_and_key_is_in_schema_order_under_its_own_description() -> None:
    expected = []
    docs = [doc for doc in keys() if not doc.array]  # the [[models]] block: its own tests below
    for table, about in tables():
        if table in ARRAYS:
            continue
        expected.append((f"[{table}]", about))
        expected += [(doc.name, doc.meaning) for doc in docs if doc.section == table]
    blocks = _blocks()
    assert [head for head, _ in blocks] == [head for head, _ in expected]
    for (head, comment), (_, description) in zip(blocks, expected, strict=True):
        assert description and comment.startswith(description.replace("`", "")), head
    assert max(map(len, SHIPPED_FILE.read_text().splitlines())) <= example.WIDTH


def test_an_override_shows_the_default_it_replaces_and_the_rest_none() -> None:
    comments = dict(_blocks())
    for doc in (doc for doc in keys() if not doc.array):
        entry = example.SHIPPED.get(doc.key)
        replaced = entry is not None and entry.value is not None and doc.default is not None
        assert (f"default {doc.default}]" in comments[doc.name]) == replaced, doc.key
    assert comments["parallel"].endswith("[int 1..64; default 1]")
    assert comments["path"].endswith("[absolute path; required]")


def _array_paragraphs(table: str = "models") -> list[str]:
    """The [[table]] block's comment paragraphs, each joined into one line, uncommented."""
    lines = SHIPPED_FILE.read_text().splitlines()
    start, end = _array_block(table)
    text = "\n".join(line.removeprefix("#").removeprefix(" ") for line in lines[start:end])
    return [" ".join(paragraph.split("\n")) for paragraph in text.split("\n\n")]


@pytest.mark.parametrize(("table", "intro", "least"), [("models", "[model] and [[models]] are exclusive", 10),
                                                   ("tenants", "To give each client its own key", 5)])
def test_an_array_block_describes_every_key_of_its_table_in_schema_order(table: str, intro: str, least: int) -> None:
    paragraphs = _array_paragraphs(table)
    about = dict(tables())[table].replace("`", "")
    assert paragraphs[0].startswith(f"[[{table}]]: {about}. {intro}")
    described = [p for p in paragraphs if p.startswith(f"{table}[].")]
    docs = [doc for doc in keys() if doc.array and doc.section == table]
    assert [p.split(":", 1)[0] for p in described] == [doc.key for doc in docs] and len(docs) >= least
    for paragraph, doc in zip(described, docs, strict=True):
        assert paragraph.startswith(f"{doc.key}: {doc.meaning.replace('`', '')}"), doc.key
        assert paragraph.endswith("; required]" if doc.default is None else f"default {doc.default}]"), doc.key


def test_the_models_example_uncommented_in_place_of_model_is_a_valid_file_and_plans_28_and_4_cores(
        tmp_path: Path) -> None:
    """What an operator does to switch: delete [model], uncomment the example. The shipped
    file leaves placement.nodes and instances_per_node unset, which [[models]] refuses."""
    from numad_infer.config.models import served_models
    from numad_infer.config.reference import MODELS_EXAMPLE
    from numad_infer.plan.placement import make_plan
    from numad_infer.topology.sysfs import read_topology
    from tests import fakesys

    lines = SHIPPED_FILE.read_text().splitlines()
    start, end = _array_block()
    example_start = next(k for k in range(start, end) if lines[k] == "# [[models]]")
    uncommented = [line.removeprefix("#").removeprefix(" ") for line in lines[example_start:end]]
    assert "\n".join(uncommented) + "\n" == MODELS_EXAMPLE
    model_table = lines.index("[model]")
    switched = "\n".join(lines[:model_table] + uncommented + lines[end:]) + "\n"
    config = parse_config(switched, SRC)
    check_engine_keys(config, SRC)
    assert config.model is None
    assert [(m.name, m.aliases, m.cores_per_instance) for m in served_models(config)] == [
        ("llama-3.1-70b", ("gpt-4o",), 28), ("llama-3.1-8b", ("gpt-4o-mini",), 4)]
    # The machine the example describes: 2 sockets, 32 cores (64 CPUs with SMT) per node.
    topo = read_topology(fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt()))
    plan = make_plan(config, topo, source=SRC)
    cores = sorted((i.model, i.node, len(i.cpus)) for i in plan.instances)
    assert cores == [("llama-3.1-70b", 0, 28), ("llama-3.1-70b", 1, 28), ("llama-3.1-8b", 0, 4),
                     ("llama-3.1-8b", 1, 4)]
    for node in (0, 1):
        here = [set(i.cpus) for i in plan.instances if i.node == node]
        assert not here[0] & here[1]
    # The shipped file with the example uncommented and [model] kept: refused in one line.
    both = "\n".join(lines[:example_start] + uncommented + lines[end:]) + "\n"
    with pytest.raises(ConfigError, match=r"models: and \[model\] are both set"):
        parse_config(both, SRC)


def test_the_tenants_example_uncommented_is_a_valid_file() -> None:
    from numad_infer.config.reference import TENANTS_EXAMPLE

    lines = SHIPPED_FILE.read_text().splitlines()
    start, end = _array_block("tenants")
    example_start = next(k for k in range(start, end) if lines[k] == "# [[tenants]]")
    uncommented = [line.removeprefix("#").removeprefix(" ") for line in lines[example_start:end]]
    assert "\n".join(uncommented) + "\n" == TENANTS_EXAMPLE
    config = parse_config("\n".join(lines[:example_start] + uncommented + lines[end:]) + "\n", SRC)
    assert [(t.name, t.max_in_flight, t.requests_per_minute) for t in config.tenants] == [
        ("chat", None, None), ("batch", 4, 600)]


def test_a_required_key_without_a_shipped_value_stops_the_generator() -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.delitem(example.SHIPPED, "model.path")
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
