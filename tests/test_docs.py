"""The configuration reference in numa-infer.toml(5) is generated from the schema, and
CONTRIBUTING.md's module layout from numad_infer/layers.py: this fails when a key, a limit, a
default, a description or a module changed without `tools/config_reference.py` or
`tools/layout_reference.py` being run. The README is the operator's short start (at most 200
lines, no module paths); the reference lives in the man pages and docs/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from numad_infer.config import reference as configref
from numad_infer.config.schema import Config

ROOT = Path(__file__).resolve().parents[1]


def test_the_key_reference_and_the_shipped_example_are_what_the_schema_says() -> None:
    """numa-infer.toml(5)'s key list and etc/numa-infer.toml; the README carries no key table."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools/config_reference.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    man = (ROOT / "packaging/man/numa-infer.toml.5").read_text()
    assert configref.MAN_BEGIN in man and ".BR cores_per_instance " in man
    readme = (ROOT / "README.md").read_text()
    assert "config-keys" not in readme and "| key | type | default | meaning |" not in readme


def test_the_contributing_layout_names_every_module_as_the_layer_map_says() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools/layout_reference.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    readme = (ROOT / "CONTRIBUTING.md").read_text()
    assert all(f"`{path.name}`" in readme for path in (ROOT / "numad_infer").glob("*.py"))


def test_the_request_path_page_is_what_the_default_golden_renders() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools/request_path.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(request-path.md)" in (ROOT / "docs/frontdoor.md").read_text()


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
    assert docs["frontend.affinity"].kind == '`"none"` or `"prefix"` or `"header"` or `"user"`'


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
        assert f"`GET {engine.liveness_path}` for {name}" in docs["tuning.probe_timeout_s"], name
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


def _man_section(text: str, name: str) -> str:
    start = text.index(f".SH {name}\n")
    return text[start:text.index("\n.SH ", start + 1)]


def test_the_man_page_describes_every_command_with_the_options_the_parser_has_and_no_other() -> None:
    """numa-infer(8)'s COMMANDS has one entry per command, whose heading names each of its
    options (and may name a global one, as `run` does `--backend`); GLOBAL OPTIONS has one
    entry per global option."""
    import re

    from numad_infer.cli import reference
    from numad_infer.cli.main import build_parser

    global_options, commands = reference.describe(build_parser())
    man = (ROOT / "packaging/man/numa-infer.8").read_text()
    headings = {m.group(1): m.group(2) for m in re.finditer(r"^\.TP\n\.B (\w+)( .*)?$", _man_section(man, "COMMANDS"),
                                                             re.M)}
    assert sorted(headings) == sorted(c.name for c in commands)
    known = {o.long for o in global_options}
    for command in commands:
        heading = (headings[command.name] or "").replace("\\-", "-").replace("\\f", " ")
        named = set(re.findall(r"--[a-z-]+", heading))
        own = {o.long for o in command.options}
        assert own <= named <= own | known, (command.name, sorted(own - named), sorted(named - own - known))
    section = _man_section(man, "GLOBAL OPTIONS").replace("\\-", "-")
    assert set(re.findall(r"^\.TP\n\.B[IR]? (--[a-z-]+)", section, re.M)) >= known, sorted(known)


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


README_MAX_LINES = 200
# The operator's README: its sections, in this order (issue 37).
README_SECTIONS = ["What it is", "Requirements", "Install", "Serve a model", "The first request", "The daily commands",
                   "When something is wrong", "Links"]


def test_the_readme_is_an_operators_start_of_at_most_200_lines() -> None:
    import re

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, len(text.splitlines())
    assert re.findall(r"^## (.+)$", text, re.M) == README_SECTIONS
    # The fresh-machine commands stay first (CI and the newcomer run them as written).
    assert text.splitlines()[5].startswith("> **Trying it or working on it?** On a fresh machine")
    assert re.search(r"^>     scripts/demo  ", text, re.M) and re.search(r"^>     scripts/test  ", text, re.M)
    # The first request: both OpenAI routes, through the front door.
    assert "http://127.0.0.1:8000/v1/completions" in text and "http://127.0.0.1:8000/v1/chat/completions" in text
    # Every anchor and relative link it gives leads somewhere.
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    anchors = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if target.startswith("#"):
            assert target[1:] in anchors, target
        elif "://" not in target:
            assert (ROOT / target.split("#")[0]).exists(), target
    for man in ("packaging/man/numa-infer.8", "packaging/man/numa-infer.toml.5"):
        assert f"`{man}`" in text and (ROOT / man).is_file()


def test_module_paths_appear_only_in_contributing() -> None:
    """`numad_infer/...`, `lifecycle/states.py`, `typedjson.py`: the code's layout is
    CONTRIBUTING.md's, and moves; the README and docs/ name commands, keys, files an operator
    has, and the tests, benchmarks and tools of this tree (`tests/e2e/test_frontdoor.py`)."""
    import re

    allowed = ("tests/", "bench/", "tools/", "scripts/", "deploy/")
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        found += [f"{path.name}: numad_infer" for _ in re.findall(r"numad_infer[/.]", text)]
        for name in re.findall(r"[\w./-]*\w\.py\b", text):
            if not name.startswith(allowed):
                found.append(f"{path.name}: {name}")
    assert found == []
