"""The front door's configuration checked before it is used (frontdoor/checked_config.py,
frontdoor/haproxy.py's validate): a refusal says HAProxy's own words, and a run directory
too deep for HAProxy's socket paths is refused naming the fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from numad_infer.config.load import parse_config
from numad_infer.frontdoor import haproxy
from numad_infer.frontdoor.checked_config import render_checked
from numad_infer.frontdoor.haproxy import HaproxyError
from numad_infer.frontdoor.haproxy_config import paths_in
from tests.fakes import load_of
from tests.frontdoor.harness import HAPROXY, plan_for

pytestmark = pytest.mark.skipif(not os.access(HAPROXY, os.X_OK), reason="haproxy not installed")


def test_a_refused_file_is_answered_with_haproxys_own_words(tmp_path: Path) -> None:
    bad = tmp_path / "haproxy.cfg"
    bad.write_text("global\n    no-such-keyword 1\n")
    with pytest.raises(HaproxyError) as refused:
        haproxy.validate(HAPROXY, str(bad))
    assert "no-such-keyword" in str(refused.value) and "unknown keyword" in str(refused.value), refused.value


def test_a_run_directory_too_deep_for_haproxys_sockets_is_refused_naming_the_fix(tmp_path: Path) -> None:
    config = parse_config('[model]\npath = "/m.gguf"\n[frontend]\nlisten = "127.0.0.1:18999"\n', "/etc/numa-infer.toml")
    served, engine = load_of(config)
    plan = plan_for(tmp_path / "plan", config)
    # tmp_path/ddd.../requests.sock: one byte longer than HAProxy takes.
    length = haproxy.SOCKET_PATH_MAX + 1 - len(f"{tmp_path}/") - len("/requests.sock")
    if length < 2:
        pytest.skip(f"{tmp_path} is itself too long for the sizes this test tries")
    run = tmp_path / ("d" * length)
    run.mkdir()
    with pytest.raises(HaproxyError) as refused:
        render_checked(config, plan, served, engine, paths_in(run, run / "haproxy.sock"))
    message = str(refused.value)
    assert f"{run}/requests.sock is {haproxy.SOCKET_PATH_MAX + 1} bytes" in message, message
    assert "--state-file" in message and f"at most {haproxy.SOCKET_PATH_MAX - len('/requests.sock')} bytes" in message
    # One byte shorter fits, and HAProxy takes it.
    fits = tmp_path / run.name[1:]
    fits.mkdir()
    render_checked(config, plan, served, engine, paths_in(fits, fits / "haproxy.sock"))
