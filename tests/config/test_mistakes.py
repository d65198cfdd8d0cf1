"""The mistakes suite: one mistake an operator makes in /etc/numa-infer.toml per row, and
what `numa-infer check` answers: every line names the file, the key (a dotted path such
as `models[1].pth`) and the fix (the word meant, the table the key belongs in,
`[[models]]`), with no traceback and no Python repr.

The rows go through the loader `check` uses (config/load.py); the model file and the key
file through the pipeline's own checks; one subprocess proves the CLI prints the line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from numad_infer.config.apikey import read_tenant_keys
from numad_infer.config.load import parse_config
from numad_infer.config.reference import heading, table_of
from numad_infer.config.schema import Config
from numad_infer.config.tuning import MOVED, TuningSection
from numad_infer.errors import ConfigError
from numad_infer.host.identity import BackendKind
from numad_infer.topology.sysfs import read_topology
from numad_infer.validate.pipeline import validate
from tests import fakesys
from tests.conftest import searchable_by_others

SRC = "/etc/numa-infer.toml"
MODEL = '[model]\npath = "/m.gguf"\n'
MODELS = '[[models]]\nname = "a"\npath = "/a.gguf"\n'
FRONT = '[frontend]\nlisten = "127.0.0.1:8000"\n'
TENANT = '[[tenants]]\nname = "{name}"\nkey_file = "/etc/numa-infer/{name}.key"\n'

# id, the file, then what its answer must hold: the key (as the line names it) and the fix.
ROWS = [
    # A typo in each table: the word meant, and every key the table allows.
    ("server-typo", MODEL + "[server]\nparalel = 4\n", "server.paralel", 'did you mean "parallel"?'),
    ("model-typo", '[model]\npath = "/m.gguf"\ncontxt_size = 8192\n', "model.contxt_size",
     'did you mean "context_size"?'),
    ("models-typo", MODELS + "contxt_size = 8192\n", "models[0].contxt_size", 'did you mean "context_size"?'),
    ("frontend-typo", MODEL + FRONT + "queue_sise = 10\n", "frontend.queue_sise", 'did you mean "queue_size"?'),
    ("monitor-typo", MODEL + "[monitor]\nstartup_grace = 3\n", "monitor.startup_grace",
     'did you mean "startup_grace_s"?'),
    ("placement-typo", MODEL + '[placement]\nreserve_cpu = "0"\n', "placement.reserve_cpu",
     'did you mean "reserve_cpus"?'),
    ("metrics-typo", MODEL + '[metrics]\nlistn = "127.0.0.1:9464"\n', "metrics.listn", 'did you mean "listen"?'),
    ("tuning-typo", MODEL + '[tuning]\nunitdir = "/run/systemd/system"\n', "tuning.unitdir",
     'did you mean "unit_dir"?'),
    ("tenants-typo", MODEL + FRONT + TENANT.format(name="a") + TENANT.format(name="b") + "max_inflight = 4\n",
     "tenants[1].max_inflight", 'did you mean "max_in_flight"?'),
    # A key of another table: where it belongs.
    ("key-of-server-in-model", '[model]\npath = "/m.gguf"\nllama_server = "/usr/bin/llama-server"\n',
     "model.llama_server", "it belongs in [server]: move it there"),
    ("key-of-server-in-frontend", MODEL + FRONT + "parallel = 4\n", "frontend.parallel",
     "it belongs in [server]: move it there"),
    # A tuning knob in the table it used to be in: refused, naming its place in [tuning].
    ("moved-prefix-wait", MODEL + "[frontend]\nprefix_wait_s = 3\n", "frontend.prefix_wait_s",
     "moved to [tuning] as prefix_wait_s; move it there"),
    ("moved-header-timeout", MODEL + FRONT + "header_timeout_s = 2\n", "frontend.header_timeout_s",
     "moved to [tuning] as header_timeout_s; move it there"),
    ("moved-probe-timeout", MODEL + "[monitor]\nprobe_timeout_s = 3\n", "monitor.probe_timeout_s",
     "moved to [tuning] as probe_timeout_s; move it there"),
    ("moved-unhealthy-after", MODEL + "[monitor]\nunhealthy_after = 3\n", "monitor.unhealthy_after",
     "moved to [tuning] as unhealthy_after; move it there"),
    ("moved-systemd-template", MODEL + '[systemd]\ntemplate = "worker"\n', "systemd.template",
     "moved to [tuning] as unit_template; move it there"),
    ("moved-systemd-unit-dir", MODEL + '[systemd]\nunit_dir = "/etc/systemd/system"\n', "systemd.unit_dir",
     "moved to [tuning] as unit_dir; move it there"),
    ("moved-systemd-typo", MODEL + '[systemd]\nunitdir = "/etc/systemd/system"\n', "systemd.unitdir",
     "[systemd] moved into [tuning]: did you mean unit_dir there?"),
    ("moved-systemd-empty", MODEL + "[systemd]\n", "systemd", "moved into [tuning] (unit_dir, unit_template)"),
    # Wrong values: what the key takes.
    ("string-for-int", MODEL + '[server]\nparallel = "4"\n', 'server.parallel = "4"',
     "must be a whole number, not a string"),
    ("negative-queue", MODEL + FRONT + "queue_size = -1\n", "frontend.queue_size = -1", "must be at least 1"),
    # The TOML forms of a table: [[models]] is an array of tables.
    ("single-bracket-models", '[models]\nname = "a"\npath = "/a.gguf"\n', "models",
     "write [[models]] (an array of tables)"),
    ("single-bracket-tenants", MODEL + FRONT + '[tenants]\nname = "a"\nkey_file = "/etc/numa-infer/a.key"\n',
     "tenants", "write [[tenants]] (an array of tables)"),
    ("tenants-beside-array", MODEL + FRONT + TENANT.format(name="a") + '[tenants]\nname = "b"\n', "tenants",
     "[tenants] at line 8 beside [[tenants]] at line 5; write [[tenants]] for each tenant, no [tenants]"),
]


def refused(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, SRC)
    return str(info.value)


def assert_operator_lines(message: str) -> None:
    """Each line names the file and a key; no traceback, no Python repr, no empty list."""
    assert "Traceback" not in message and "{" not in message and "dict" not in message, message
    assert not re.search(r"\bnot (str|int|float|bool|list)\b", message), message
    assert "allowed here: )" not in message, message
    for line in message.splitlines():
        assert line.startswith(SRC + ": ") and len(line) > len(SRC) + 2, message


@pytest.mark.parametrize("text, key, fix", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_each_mistake_is_answered_with_its_key_and_fix(text: str, key: str, fix: str) -> None:
    message = refused(text)
    assert_operator_lines(message)
    assert message.startswith(f"{SRC}: {key}: "), message
    assert fix in message, message


def test_two_problems_in_one_table_are_both_shown_each_on_its_own_line() -> None:
    message = refused(MODELS + '[[models]]\nname = "b"\npth = "/b.gguf"\ncontext_size = "big"\n')
    assert_operator_lines(message)
    lines = message.splitlines()
    assert lines[0].startswith(f'{SRC}: models[1].pth: unknown key; did you mean "path"?'), message
    assert f'{SRC}: models[1].context_size = "big": must be a whole number, not a string' in lines, message
    assert f"{SRC}: models[1].path: is required; add path = <absolute path> to that [[models]] table" in lines
    assert len(lines) == 3 and "more problem" not in message


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_every_moved_key_is_refused_in_its_old_place_in_one_line_naming_the_new(old: str, new: str) -> None:
    """Never ignored, never read as something else: each knob's old spelling is one line
    naming `[tuning]` and its name there; the same value there loads and is what the old
    attribute reads (frontdoor code reads `config.frontend.prefix_wait_s`)."""
    table, key = old.split(".")
    kind = TuningSection.model_fields[new].annotation
    value = {"unit_dir": '"/etc/systemd/system"', "template": '"worker"'}.get(key, "32" if kind is int else "3.5")
    message = refused(f"{MODEL}[{table}]\n{key} = {value}\n")
    assert message == f"{SRC}: {old}: moved to [tuning] as {new}; move it there"
    config = parse_config(f"{MODEL}[tuning]\n{new} = {value}\n", SRC)
    read = config.systemd.template if key == "template" else getattr(getattr(config, table), key)
    assert read == getattr(config.tuning, new) != getattr(TuningSection(), new)


def test_moved_keys_are_each_answered_among_other_problems() -> None:
    message = refused(MODEL + "[frontend]\nprefix_wait_s = 3\nqueue_size = 0\n"
                      '[systemd]\ntemplate = "w"\nunit_dir = "/x"\n')
    assert_operator_lines(message)
    lines = message.splitlines()
    assert f"{SRC}: frontend.prefix_wait_s: moved to [tuning] as prefix_wait_s; move it there" in lines
    assert f"{SRC}: systemd.template: moved to [tuning] as unit_template; move it there" in lines
    assert f"{SRC}: systemd.unit_dir: moved to [tuning] as unit_dir; move it there" in lines
    assert f"{SRC}: frontend.queue_size = 0: must be at least 1" in lines and len(lines) == 4


@pytest.mark.parametrize("section", list(Config.model_fields))
def test_every_table_has_did_you_mean_and_allowed_from_the_schema(section: str) -> None:
    """One rule for every table, arrays of tables included: a key one letter off one of the
    table's own keys gets that key and the table's keys, read from the schema."""
    table, array = table_of(section)
    key = next(k for k in table.model_fields if len(k) > 3)
    typo = key[:-1] + "x" + key[-1]
    required = "".join(f'{k} = "/n.gguf"\n' if k == "path" else f'{k} = "ab"\n'
                       for k, f in table.model_fields.items() if f.is_required() and k != key)
    text = f"{heading(section)}\n{required}{typo} = 1\n"
    message = refused(text).splitlines()[0]
    where = f"{section}[0]" if array else section
    assert message == (f'{SRC}: {where}.{typo}: unknown key; did you mean "{key}"? '
                       f"(allowed here: {', '.join(table.model_fields)})")


@pytest.fixture
def fake_server(tmp_path: Path) -> Path:
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\ncase \"$1\" in\n--version) echo 'version: 1 (fake)' ;;\n"
                      "--help) echo '--api-key-file' ;;\n*) exit 0 ;;\nesac\n")
    server.chmod(0o755)
    return server


@pytest.mark.parametrize("content, fix", [
    (None, "file not found; put a GGUF model there or fix the path"),
    (b"<html>not a model</html>" + b"\0" * 64, "GGUF"),
], ids=["missing-model-file", "not-gguf-model-file"])
def test_the_model_file_is_answered_with_its_key_and_fix(tmp_path: Path, fake_server: Path,
                                                         content: bytes | None, fix: str) -> None:
    model = searchable_by_others(tmp_path) / "model.gguf"
    if content is not None:
        model.write_bytes(content)
        model.chmod(0o644)
    config = parse_config(f'[model]\npath = "{model}"\n[server]\nllama_server = "{fake_server}"\n', SRC)
    topology = read_topology(fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt()))
    with pytest.raises(ConfigError) as info:
        validate(config, SRC, topology, BackendKind.PROCESS, unit_dirs=())
    message = str(info.value)
    assert_operator_lines(message)
    assert message.startswith(f'{SRC}: model.path = "{model}": '), message
    assert fix in message, message


def test_a_key_file_others_can_read_is_answered_with_chmod(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    key_file = keys / "a.key"
    key_file.write_text("0123456789abcdef\n")
    key_file.chmod(0o644)
    config = parse_config(MODEL + FRONT + f'[[tenants]]\nname = "a"\nkey_file = "{key_file}"\n', SRC)
    with pytest.raises(ConfigError) as info:
        read_tenant_keys(config, SRC)
    message = str(info.value)
    assert_operator_lines(message)
    assert message.startswith(f'{SRC}: tenants[0].key_file = "{key_file}": '), message
    assert f"(mode 0644); chmod 600 {key_file}" in message, message


def test_the_cli_prints_the_same_line_and_fails(tmp_path: Path) -> None:
    config = tmp_path / "numa-infer.toml"
    text = '[model]\npath = "/m.gguf"\nllama_server = "/usr/bin/llama-server"\n'
    config.write_text(text)
    expected = refused(text).replace(SRC, str(config))
    proc = subprocess.run([sys.executable, "-m", "numad_infer", "check", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.strip() == f"numa-infer: {expected}"
    assert "model.llama_server: unknown key; it belongs in [server]: move it there" in proc.stderr


def test_the_cli_prints_every_problem_on_its_own_line(tmp_path: Path) -> None:
    config = tmp_path / "numa-infer.toml"
    config.write_text('[[models]]\nname = "a"\npth = "/a.gguf"\ncontxt_size = 4096\n')
    proc = subprocess.run([sys.executable, "-m", "numad_infer", "check", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "\\n" not in proc.stderr
    assert len(lines) == 3 and all(line.startswith(f"numa-infer: {config}: models[0].") for line in lines), lines
    assert any("pth" in line and '"path"' in line for line in lines), lines
