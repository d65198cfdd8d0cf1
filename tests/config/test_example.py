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

from numad_infer.config import example
from numad_infer.config.load import load_config, parse_config
from numad_infer.config.reference import keys, tables
from numad_infer.config.schema import Config
from numad_infer.engines.keys import check_engine_keys
from numad_infer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_FILE = ROOT / example.PATH
SRC = "/etc/numa-infer.toml"


def _values(config: Config) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, table in config.model_dump().items()
            for key, value in table.items()}


def _commented() -> dict[str, str]:
    """`section.key` -> the TOML value of each key the file shows commented out."""
    found, section = {}, ""
    for line in SHIPPED_FILE.read_text().splitlines():
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
    for line in SHIPPED_FILE.read_text().splitlines():
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
    docs = keys()
    for table, about in tables():
        expected.append((f"[{table}]", about))
        expected += [(doc.name, doc.meaning) for doc in docs if doc.section == table]
    blocks = _blocks()
    assert [head for head, _ in blocks] == [head for head, _ in expected]
    for (head, comment), (_, description) in zip(blocks, expected, strict=True):
        assert description and comment.startswith(description.replace("`", "")), head
    assert max(map(len, SHIPPED_FILE.read_text().splitlines())) <= example.WIDTH


def test_an_override_shows_the_default_it_replaces_and_the_rest_none() -> None:
    comments = dict(_blocks())
    for doc in keys():
        entry = example.SHIPPED.get(doc.key)
        replaced = entry is not None and entry.value is not None and doc.default is not None
        assert (f"default {doc.default}]" in comments[doc.name]) == replaced, doc.key
    assert comments["parallel"].endswith("[int 1..64; default 1]")
    assert comments["path"].endswith("[absolute path; required]")


def test_a_required_key_without_a_shipped_value_stops_the_generator() -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.delitem(example.SHIPPED, "model.path")
        with pytest.raises(ValueError, match=r"model\.path is required"):
            example.example_toml()


def test_the_file_a_missing_config_points_to_is_the_one_the_package_installs() -> None:
    with pytest.raises(ConfigError) as missing:
        load_config(ROOT / "no-such-dir" / "numa-infer.toml")
    named = re.search(r"copy (\S+)", str(missing.value))
    assert named is not None and named[1] == "/usr/share/doc/numa-infer/examples/numa-infer.toml"
    # dh_installexamples puts each file debian/numa-infer.examples lists there; dh_install the conffile.
    assert example.PATH in (ROOT / "debian/numa-infer.examples").read_text().split()
    assert f"{example.PATH} etc/" in (ROOT / "debian/numa-infer.install").read_text().splitlines()
