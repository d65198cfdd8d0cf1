"""Property-based: every string and number of the config, hostile or not (hypothesis).

Never a traceback (a value is accepted or refused with a ConfigError), never a directive
or argument the input did not ask for, systemd's own parser accepts every unit `render`
writes, and a refused config writes nothing.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from numad_infer.units.render import render_units
from numad_infer.cli import main as cli
from numad_infer.config.load import parse_config
from numad_infer.engines import engine_of
from numad_infer.errors import ConfigError
from numad_infer.plan.placement import make_plan
from numad_infer.topology.sysfs import read_topology
from tests import fakesys
from tests.unitfiles import directives, systemd_split, systemd_verify
from tests.fakes import load_of, served_of

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)  # anything, control characters included
PRINTABLE = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=30)  # quotes, %, $, spaces, unicode
NUMBER = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans())


def either(valid: st.SearchStrategy) -> st.SearchStrategy:
    # Mostly values that pass the schema (so rendering is exercised), sometimes anything.
    return st.one_of(valid, valid, valid, TEXT, NUMBER)


PATH = PRINTABLE.map(lambda t: "/" + t)
PORT = st.integers(1, 70000)
LISTEN = st.builds(lambda h, p: f"{h}:{p}", st.sampled_from(["127.0.0.1", "0.0.0.0", "[::1]", "10.0.0.1", "::1"]), PORT)
# Every string and number key of the schema, with what a hostile or careless operator might write.
KEYS = {
    "model": {"context_size": either(st.integers(0, 2**21)), "mlock": either(st.booleans())},
    "placement": {"reserve_cpus": either(st.sampled_from(["", "0", "0,64", "0-1", "127", "5-3"])),
                  "instances_per_node": either(st.integers(0, 40)), "smt": either(st.booleans()),
                  "mode": either(st.sampled_from(["per-node", "interleave"]))},
    "server": {"host": either(st.sampled_from(["127.0.0.1", "0.0.0.0", "::1", "::"])),
               "base_port": either(PORT), "python": either(PATH), "extra_args": st.lists(PRINTABLE | TEXT, max_size=4)},
    "monitor": {"interval_s": either(st.floats(0, 4000)), "min_local_fraction": either(st.floats(-1, 2))},
    "metrics": {"listen": either(LISTEN | st.just(""))},
    "frontend": {"listen": either(LISTEN | st.just("")), "haproxy": either(PATH),
                 "queue_size": either(st.integers(0, 200_000)), "queue_timeout_s": either(st.floats(0, 4000)),
                 "batch_queue_timeout_s": either(st.floats(0, 4000)),
                 "affinity": either(st.sampled_from(["none", "prefix", "header", "user"])),
                 "affinity_header": either(st.from_regex(r"[A-Za-z0-9-]{1,20}", fullmatch=True))},
    "tuning": {"unit_template": either(st.from_regex(r"[A-Za-z][A-Za-z0-9_.:-]{0,12}", fullmatch=True)),
               "unit_dir": either(PATH), "probe_timeout_s": either(st.floats(0, 700)),
               "unhealthy_after": either(st.integers(0, 2000)), "prefix_bytes": either(st.integers(-1, 70_000)),
               "prefix_balance_factor": either(st.floats(0, 12))},
}


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    # JSON escapes are TOML basic-string escapes; TOML also wants DEL escaped.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


@st.composite
def documents(draw) -> str:
    lines = ['[model]', f'path = "{MODEL}"']
    sections: dict[str, list[str]] = {}
    for section, keys in KEYS.items():
        for key in draw(st.sets(st.sampled_from(sorted(keys)), max_size=2)) if draw(st.integers(0, 2)) == 0 else ():
            sections.setdefault(section, []).append(f"{key} = {toml_value(draw(keys[key]))}")
    for name, body in sections.items():
        if name == "model":
            lines += body
        else:
            lines += [f"[{name}]", *body]
    return "\n".join(lines) + "\n"


# One machine and one model file for every example: a refusal must come from the input.
BASE = Path(tempfile.mkdtemp(prefix="numa-infer-fuzz-"))
FSROOT = fakesys.write_tree(BASE / "fs", fakesys.dual_socket_smt())
MODEL = BASE / "m.gguf"
MODEL.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\0" * 56)  # version 3, no tensors, no metadata
TOPOLOGY = read_topology(FSROOT)


def topology():
    return TOPOLOGY


def rendered(text: str) -> dict[str, str] | None:
    """The units of an accepted config; None when refused (by the schema or the planner)."""
    try:
        config = parse_config(text, "/etc/numa-infer.toml")
        plan = make_plan(config, topology(), source="/etc/numa-infer.toml", served=served_of(config))
    except ConfigError:
        return None
    served, engine = load_of(config)
    return config, plan, render_units(config, plan, served=served, engine=engine)


# The directives numa-infer writes; an input can only choose their values.
ALLOWED = {
    "Description", "After", "Documentation", "Type", "Restart", "RestartSec", "TimeoutStopSec", "DynamicUser",
    "ProtectHome", "SystemCallFilter", "SystemCallErrorNumber", "IPAddressDeny", "IPAddressAllow", "Environment",
    "LimitMEMLOCK", "CPUAffinity", "NUMAPolicy", "NUMAMask", "ExecStart", "ExecStartPre", "ExecReload", "KillMode", "KillSignal",
    "RuntimeDirectory", "RuntimeDirectoryMode", "User", "Group", "AmbientCapabilities", "CapabilityBoundingSet", "PrivateUsers", "NoNewPrivileges",
    "ProtectSystem", "PrivateTmp", "PrivateDevices", "PrivateMounts", "ProtectKernelTunables", "ProtectKernelModules",
    "ProtectKernelLogs", "ProtectControlGroups", "ProtectClock", "ProtectHostname", "ProtectProc", "RestrictNamespaces",
    "RestrictSUIDSGID", "LockPersonality", "RestrictRealtime", "RestrictAddressFamilies", "SystemCallArchitectures",
    "UMask",
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents())
# Found by this test: U+0085 (NEL, a C1 control) once passed as an argument, and Python's
# splitlines broke the unit there; U+2028 and U+2029 break a line the same way.
@example(f'[model]\npath = "{MODEL}"\n[server]\nextra_args = ["\u0085"]\n')
@example(f'[model]\npath = "{MODEL}"\n[server]\nextra_args = ["a\u2028b", "\u2029"]\n')
def test_any_config_is_accepted_or_refused_in_one_line_and_renders_only_what_it_asked(text: str) -> None:
    result = rendered(text)  # raises anything but ConfigError: a failure
    if result is None:
        return
    config, plan, files = result
    for rel, unit in files.items():
        lines = unit.splitlines()
        assert all(line == "" or line.startswith(("#", "[")) or "=" in line for line in lines), unit
        assert {key for key, _ in directives(unit)} <= ALLOWED, rel
        # Each value stays on its own line: a newline in the input never starts a directive.
        assert sum(1 for line in lines if line.startswith("ExecStart=")) <= 1
    for instance in plan.instances:
        dropin = files[f"{instance.unit}.d/50-numa-infer.conf"]
        exec_start = dict(directives(dropin))["ExecStart"]
        # Exactly the arguments the config asked for, each one whole.
        assert systemd_split(exec_start) == engine_of(config).argv(config, instance)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(documents())
def test_systemd_accepts_every_unit_render_writes(text: str) -> None:
    result = rendered(text)
    if result is None:
        return
    config, plan, files = result
    with tempfile.TemporaryDirectory() as scratch:
        unit_dir = Path(scratch)
        for rel, unit in files.items():
            (unit_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (unit_dir / rel).write_text(unit)
        names = [i.unit for i in plan.instances[:2]]
        out = systemd_verify(unit_dir, names)
        # verify checks that the configured interpreter exists; the fuzzed path need not.
        problems = [line for line in out.splitlines() if "is not executable" not in line and "No such file" not in line
                    and "rc=" not in line and line.strip()]
        assert not problems, out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents())
def test_a_refused_config_writes_nothing(text: str) -> None:
    if rendered(text) is not None:
        return
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch)
        (base / "numa-infer.toml").write_text(text)
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = cli.main(["--config", str(base / "numa-infer.toml"), "--fsroot", str(FSROOT),
                             "render", "--output", str(base / "units")])
        assert code == 1 and not (base / "units").exists()
        # One line a problem, each naming the file (several problems of one file: several lines).
        lines = err.getvalue().splitlines()
        assert lines and all(line.startswith("numa-infer: ") for line in lines), err.getvalue()
        assert "Traceback" not in err.getvalue()
