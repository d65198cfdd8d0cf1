"""The configuration reference in README.md and numa-infer.toml(5) is generated from the
schema, and CONTRIBUTING.md's module layout from numad_infer/layers.py: this fails when a key,
a limit, a default, a description or a module changed without `tools/config_reference.py`
or `tools/layout_reference.py` being run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from numad_infer.config import reference as configref
from numad_infer.config.schema import Config

ROOT = Path(__file__).resolve().parents[1]


def test_the_key_reference_and_the_shipped_example_are_what_the_schema_says() -> None:
    """README.md's key table, numa-infer.toml(5)'s key list and etc/numa-infer.toml."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools/config_reference.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_contributing_layout_names_every_module_as_the_layer_map_says() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools/layout_reference.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    readme = (ROOT / "CONTRIBUTING.md").read_text()
    assert all(f"`{path.name}`" in readme for path in (ROOT / "numad_infer").glob("*.py"))


def test_every_key_has_a_description_and_the_limits_are_shown() -> None:
    docs = {d.key: d for d in configref.keys()}
    expected = set()
    for section in Config.model_fields:
        table, array = configref.table_of(section)
        expected |= {f"{section}{'[]' if array else ''}.{k}" for k in table.model_fields}
    assert set(docs) == expected and "models[].cores_per_instance" in docs and "model.path" in docs
    assert configref.table_of("model")[1] is False and configref.heading("models") == "[[models]]"
    assert docs["models[].threads"].default == "placement.threads" and docs["models[].name"].default is None
    assert all(d.meaning for d in docs.values()), [k for k, d in docs.items() if not d.meaning]
    assert [name for name, about in configref.tables() if about] == list(Config.model_fields)
    assert docs["model.context_size"].kind == "int 64..1048576"
    assert docs["monitor.interval_s"].kind == "float > 0, <= 3600"
    assert docs["monitor.restart_window_s"].kind == "float > 0"
    assert docs["placement.instances_per_node"].kind == "int 1..256"
    assert docs["server.engine"].default == '"llama-server"' and docs["model.path"].default is None
    assert docs["frontend.affinity"].kind == '`"none"` or `"header"` or `"user"`'


def test_what_the_descriptions_say_of_each_engine_is_what_the_engine_says() -> None:
    """The reference names each built-in engine's own keys and its probe route, and marks
    those keys as its own: the engines, not the schema, decide them."""
    import re

    from numad_infer.engines.base import engines

    docs = {d.key: d.meaning for d in configref.keys()}
    builtin = {e.name: e for e in engines() if e.name in ("llama-server", "llama-cpp-python")}
    assert len(builtin) == 2
    # "A key of the engine not chosen is refused: `a` and `b` are x's, `c` y's; ..."
    owners = docs["server.engine"].split("is refused: ", 1)[1].split(";", 1)[0]
    named = {owner: set(re.findall(r"`(\w+)`", keys))
             for keys, owner in re.findall(r"((?:`\w+`(?: and )?)+) (?:are |is )?([\w.-]+)'s", owners)}
    assert named == {name: set(e.own_keys) for name, e in builtin.items()}
    for name, engine in builtin.items():
        assert f"`GET {engine.liveness_path}` for {name}" in docs["monitor.probe_timeout_s"], name
        assert all(docs[f"server.{key}"].startswith(f"{name} only: ") for key in engine.own_keys), name


def test_roff_escaping_keeps_code_and_backslashes() -> None:
    assert configref._roff("no `$ \" ' \\` here") == "no \\fB$ \" ' \\e\\fR here"
    assert configref._roff(".starts with a dot") == "\\&.starts with a dot"
    assert configref._roff("`--api-key`") == "\\fB\\-\\-api\\-key\\fR"


def test_every_file_and_test_the_where_to_change_table_names_exists() -> None:
    """CONTRIBUTING.md's "where to change what" rows name files and tests: a rename must not
    leave a row pointing at nothing."""
    import ast
    import re

    readme = (ROOT / "CONTRIBUTING.md").read_text()
    table = readme[readme.index("Where to change what"):readme.index("## Tests")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) >= 10 and all("`tests/" in row for row in rows), [r for r in rows if "`tests/" not in r]
    for path in re.findall(r"`(numad_infer/[\w/]+(?:\.py|/))`", table):
        assert (ROOT / path).exists(), path
    for path, name in re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", table):
        assert (ROOT / path).is_file(), path
        if name:
            tree = ast.parse((ROOT / path).read_text())
            assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, f"{path}::{name}"


def test_the_man_synopsis_and_bash_completion_are_what_the_parser_says() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools/cli_reference.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check = subprocess.run(["bash", "-n", str(ROOT / "packaging/completion/numa-infer.bash")], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stderr


def test_the_readme_lists_every_command_with_the_options_the_parser_has_and_no_other() -> None:
    import re

    from numad_infer.cli import reference
    from numad_infer.cli.main import build_parser

    global_options, commands = reference.describe(build_parser())
    documented = re.findall(r"^\| `(numa-infer [^`]*)` \|", (ROOT / "README.md").read_text(), re.M)
    assert sorted(documented) == sorted(reference.synopsis(c) for c in commands)
    # The global options, as the README's paragraph under the table names them.
    text = (ROOT / "README.md").read_text()
    assert all(f"`{o.long} " in text or f"`{o.long}`" in text for o in global_options)


def test_the_synopsis_generator_shows_arguments_choices_and_exclusive_flags() -> None:
    import argparse

    from numad_infer.cli import reference

    parser = argparse.ArgumentParser(prog="numa-infer")
    parser.add_argument("--config", metavar="FILE")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("probe", help="a probe")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--mode", choices=("a", "b"))
    which = p.add_mutually_exclusive_group()
    which.add_argument("--live", action="store_true")
    which.add_argument("--ready", action="store_true")
    global_options, (probe,) = reference.describe(parser)
    assert [o.long for o in global_options] == ["--config"] and probe.help == "a probe"
    assert reference.synopsis(probe) == "numa-infer probe [--verbose] [--mode a\\|b] [--live\\|--ready]"
    man = reference.man_synopsis(parser)
    assert ".RB [ \\-v | \\-\\-verbose ]" in man and ".BR a | b ]" in man and ".RB [ \\-\\-live | \\-\\-ready ]" in man
    completion = reference.bash_completion(parser)
    assert "probe) opts=\"-v --verbose --mode --live --ready\" ;;" in completion
    assert "compgen -W 'a b'" in completion and "_filedir toml" in completion


_EXTENSIONS = {"py", "md", "json", "toml", "yaml", "gguf", "service", "cfg", "sh", "bash"}  # `config/frontend.py`
DOCUMENTS = ["README.md", "CONTRIBUTING.md", "docs/*.md", "bench/README.md", "debian/README.Debian",
             "packaging/man/*.[58]", "etc/numa-infer.toml", "deploy/kubernetes/**/*.yaml"]


def _documents() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text() for pattern in DOCUMENTS for path in sorted(ROOT.glob(pattern))}


def test_every_configuration_key_the_docs_name_exists() -> None:
    """`frontend.health_path` in any document is a key of the schema: a renamed or removed
    key fails here, not in an operator's config."""
    import re

    sections = {name: configref.table_of(name)[0] for name in Config.model_fields}
    # `models[].name`, `models[1].path` and `models[k].parallel` name a key of the [[models]] tables.
    pattern = re.compile(r"\b(%s)(?:\[\w*\])?\.([a-z_]+)\b" % "|".join(sections))
    man_pages = {"systemd.exec", "systemd.resource", "systemd.service", "systemd.unit"}  # `systemd.exec (5)`
    unknown = set()
    for name, text in _documents().items():
        for line in text.replace("\\-", "-").replace("\\&", "").splitlines():
            if "unknown key" in line:
                continue  # an example of the error a misspelt key gets
            for section, key in pattern.findall(line):
                fields = getattr(sections[section], "model_fields", {})
                if key not in fields and f"{section}.{key}" not in man_pages and key not in _EXTENSIONS:
                    unknown.add(f"{name}: {section}.{key}")
    assert sorted(unknown) == []


def test_every_numa_infer_command_the_docs_name_exists() -> None:
    import re

    from numad_infer.cli import reference
    from numad_infer.cli.main import build_parser

    _, commands = reference.describe(build_parser())
    known = {c.name for c in commands}
    named = {(name, m) for name, text in _documents().items()
             for m in re.findall(r"`numa-infer(?: --[a-z-]+(?: [^\s<`]\S*)?)* ([a-z]+)\b", text)}
    assert {f"{name}: numa-infer {m}" for name, m in named if m not in known} == set()
