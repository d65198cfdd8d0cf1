"""Config errors name the file, the key, the value and what is allowed; nothing else leaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from numad_infer.config.load import load_config, parse_config
from numad_infer.errors import ConfigError

SRC = "/etc/numa-infer.toml"
BASE = '[model]\npath = "/m.gguf"\n'


@pytest.mark.parametrize(
    "text, expected",
    [
        ('[model]\npath = "/m.gguf"\n[placement]\nmode = "per-node\n',
         "/etc/numa-infer.toml: invalid TOML: "),
        (BASE + "[placement]\nreserve_cpu = \"0\"\n",
         '/etc/numa-infer.toml: placement.reserve_cpu: unknown key; did you mean "reserve_cpus"?'),
        ("[modle]\npath = \"/m\"\n", '/etc/numa-infer.toml: modle: unknown key; did you mean "model"?'),
        (BASE + "[placement]\nsmt = \"yes\"\n", '/etc/numa-infer.toml: placement.smt = "yes": must be true or false, not a string'),
        (BASE + "[server]\nbase_port = \"8080\"\n", '/etc/numa-infer.toml: server.base_port = "8080": must be a whole number'),
        (BASE + "[server]\nbase_port = 70000\n", "/etc/numa-infer.toml: server.base_port = 70000: must be at most 65535"),
        (BASE + "[placement]\nnodes = \"some\"\n", '/etc/numa-infer.toml: placement.nodes = "some": must be "all" or a list'),
        (BASE + "[placement]\nnodes = [0, 0]\n", "placement.nodes = [0, 0]: lists a node more than once"),
        (BASE + '[placement]\nmode = "interleaved"\n', "placement.mode = \"interleaved\": must be one of 'per-node' or 'interleave'"),
        (BASE + '[placement]\nreserve_cpus = "0-a"\n', 'placement.reserve_cpus = "0-a": not a CPU list'),
        ('[model]\npath = "m.gguf"\n', 'model.path = "m.gguf": must be an absolute path'),
        ("[placement]\nsmt = true\n", "/etc/numa-infer.toml: model: is required"),
        (BASE + '[server]\npython = "/opt/$ENV/python3"\n', 'server.python = "/opt/$ENV/python3": may not contain $'),
        (BASE + '[server]\npython = "/opt/a\\"b/python3"\n', 'may not contain "'),
        (BASE + '[metrics]\nlisten = "localhost:9464"\n', 'metrics.listen = "localhost:9464": \'localhost\' is not an IP address'),
        (BASE + '[metrics]\nlisten = "127.0.0.1"\n', 'metrics.listen = "127.0.0.1": must be "ADDRESS:PORT"'),
        (BASE + '[server]\nhost = "localhost"\n', 'server.host = "localhost": must be an IP address'),
        # A zone ID carried anything into haproxy.cfg: this one rendered a second directive.
        (BASE + '[frontend]\nlisten = "[fe80::1%lo]:8000 accept-proxy #]:8000"\n',
         'frontend.listen = "[fe80::1%lo]:8000 accept-proxy #]:8000": has an IPv6 zone ID (%...), which numa-infer '
         'does not take; use an address without one'),
        (BASE + '[frontend]\nlisten = "[fe80::1%lo]:8000"\n', 'frontend.listen = "[fe80::1%lo]:8000": has an IPv6 zone ID'),
        (BASE + '[metrics]\nlisten = "[fe80::1%eth0]:9464"\n', 'metrics.listen = "[fe80::1%eth0]:9464": has an IPv6 zone'),
        (BASE + '[server]\nhost = "fe80::1%lo"\n', 'server.host = "fe80::1%lo": has an IPv6 zone ID'),
        (BASE + '[server]\nhost = "::1 #"\n', 'server.host = "::1 #": must be an IP address'),
        (BASE + '[frontend]\nlisten = "127.0.0.1 :8000"\n', "frontend.listen = \"127.0.0.1 :8000\": '127.0.0.1 ' is not an IP"),
        (BASE + '[tuning]\nunit_template = "in fer"\n', 'tuning.unit_template = "in fer": must start with a letter, then up to 63 of'),
    ],
)
def test_invalid_config_message(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, SRC)
    assert expected in str(info.value)


def test_invalid_toml_names_the_line() -> None:
    with pytest.raises(ConfigError, match=r"line 4"):
        parse_config(BASE + "[server]\nbase_port = = 1\n", SRC)


@pytest.mark.parametrize("key, raw", [
    ("model.path", '[model]\npath = "/m\\nExecStartPre=/bin/sh"\n'),
    ("model.path", '[model]\npath = "/m\\r"\n'),
    ("model.path", '[model]\npath = "/m\\u0000x"\n'),
    ("server.extra_args[1]", BASE + '[server]\nextra_args = ["--a", "b\\nc"]\n'),
    ("server.python", BASE + '[server]\npython = "/usr/bin/python3\\n"\n'),
    ("tuning.unit_dir", BASE + '[tuning]\nunit_dir = "/run/x\\ty"\n'),
    ("placement.reserve_cpus", BASE + '[placement]\nreserve_cpus = "0\\n"\n'),
])
def test_control_characters_are_rejected_in_every_string(key: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(raw, SRC)
    # An argument list may hold a secret: its items are named, never shown.
    shown = f"{SRC}: {key}: " if key.startswith("server.extra_args") else f"{SRC}: {key} = "
    assert shown in str(info.value) and "control character" in str(info.value)


def test_defaults_are_the_documented_ones() -> None:
    config = parse_config(BASE, SRC)
    assert (config.placement.mode, config.placement.nodes, config.placement.smt) == ("per-node", "all", False)
    assert (config.server.host, config.server.base_port, config.systemd.template) == ("127.0.0.1", 8080, "infer")
    assert config.monitor.min_local_fraction == 0.9
    assert config.metrics.listen == ""  # metrics are off unless the operator asks
    assert parse_config(BASE + '[metrics]\nlisten = "[::1]:9464"\n', SRC).metrics.listen == "[::1]:9464"


def test_example_config_in_etc_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "etc" / "numa-infer.toml"
    assert load_config(example).model.path == "/var/lib/numa-infer/models/model.gguf"


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.toml: file not found"):
        load_config(tmp_path / "nope.toml")
