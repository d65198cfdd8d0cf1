"""haproxy.cfg byte for byte as the code rendered it when each golden was written
(tests/golden_haproxy/: a TOML and its .cfg), and HAProxy's `-c` on it. A change to the
rendered text is a deliberate one: rerun with NUMA_INFER_UPDATE_GOLDEN=1 and read the diff."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from numad_infer.frontdoor.haproxy_config import write_config
from tests.frontdoor import golden_haproxy as golden
from tests.frontdoor.harness import HAPROXY, with_haproxy


def test_there_are_goldens_for_the_cases_the_issue_names() -> None:
    assert {"default", "two_models", "tenants", "affinity_none", "one_instance"} <= set(golden.cases())


@pytest.mark.parametrize("name", golden.cases())
def test_the_rendered_config_is_the_golden(tmp_path: Path, name: str) -> None:
    if os.environ.get(golden.UPDATE_VARIABLE):
        golden.update(tmp_path / "update")
    text = golden.normalised(golden.render(name, tmp_path), tmp_path)
    assert text == golden.golden_path(name).read_text(encoding="utf-8"), \
        f"{name}: haproxy.cfg changed; if on purpose, rerun with {golden.UPDATE_VARIABLE}=1"


@with_haproxy
@pytest.mark.parametrize("name", golden.cases())
def test_haproxy_accepts_the_golden(tmp_path: Path, name: str) -> None:
    text = golden.render(name, tmp_path)
    paths = golden.paths_for(tmp_path)
    write_config(paths, text)
    done = subprocess.run([HAPROXY, "-c", "-q", "-f", str(paths.config)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr + done.stdout
