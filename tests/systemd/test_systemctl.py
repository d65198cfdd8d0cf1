"""systemd/systemctl.py: how systemctl is called. systemd is not PID 1 on these hosts, so a
stand-in script records the arguments it is given; the real systemctl runs in the VM suite
(tests/vm). What the systemd backend makes of systemctl's answers: tests/backends/test_systemd.py."""

from __future__ import annotations

from pathlib import Path


def test_every_systemctl_call_ends_its_options_before_unit_names(tmp_path: Path) -> None:
    from numad_infer.systemd.systemctl import Systemctl

    log = tmp_path / "calls"
    fake = tmp_path / "systemctl"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    fake.chmod(0o755)
    ctl = Systemctl(str(fake))
    ctl.start("infer@0.service")
    ctl.stop("infer@0.service")
    ctl.restart("infer@0.service")
    ctl.reload("numa-infer-frontdoor.service")
    ctl.show_many(["infer@0.service"], "MainPID")
    for line in log.read_text().splitlines():
        words = line.split()
        assert "--" in words and words.index("--") < words.index(next(w for w in words if w.endswith(".service"))), line
