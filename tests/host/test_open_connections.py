"""A retiring instance's requests in flight: only connections its own listener accepted
count (host/portowner.open_connections), never another local user's on the same port."""

from __future__ import annotations

from pathlib import Path

from numad_infer.host.portowner import open_connections
from numad_infer.host.procfs import ProcReader

INSTANCE_PID, INSTANCE_UID = 42, 61000  # under systemd a DynamicUser of its own
HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"


def _row(k: int, local: str, remote: str, state: str, uid: int) -> str:
    return (f" {k:3d}: {local} {remote} {state} 00000000:00000000 00:00000000 00000000 {uid:5d}        0 "
            f"{k + 900} 1 0 20 4 28 10 -1")


# The instance listens (0A) on 127.0.0.1:8080 (1F90) and has two clients (ESTABLISHED, 01).
INSTANCE = [_row(0, "0100007F:1F90", "00000000:0000", "0A", INSTANCE_UID),
            _row(1, "0100007F:1F90", "0100007F:D920", "01", INSTANCE_UID),
            _row(2, "0100007F:1F90", "0100007F:D926", "01", INSTANCE_UID),
            # The front door's own end of one of them: its port is the ephemeral one.
            _row(3, "0100007F:D920", "0100007F:1F90", "01", 0)]
# Another user (nobody) listens on 127.0.0.2:8080 and holds connections to it open; and a
# connection of another uid at the instance's own address.
ATTACK = [_row(10, "0200007F:1F90", "00000000:0000", "0A", 65534),
          _row(11, "0200007F:1F90", "0100007F:D930", "01", 65534),
          _row(12, "0200007F:1F90", "0100007F:D932", "01", 65534),
          _row(13, "0100007F:1F90", "0100007F:D934", "01", 65534)]


def _proc(tmp_path: Path, rows: list[str], tcp6: tuple[str, ...] = ()) -> Path:
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    (proc / "net" / "tcp").write_text("\n".join([HEADER, *rows]) + "\n")
    (proc / "net" / "tcp6").write_text("\n".join([HEADER, *tcp6]) + "\n")
    (proc / str(INSTANCE_PID)).mkdir()
    (proc / str(INSTANCE_PID) / "status").write_text(
        f"Name:\tllama-server\nPid:\t{INSTANCE_PID}\nUid:\t{INSTANCE_UID}\t{INSTANCE_UID}\t{INSTANCE_UID}\t"
        f"{INSTANCE_UID}\n")
    return proc


def test_the_instances_connections_are_those_its_listener_accepted(tmp_path: Path) -> None:
    proc = _proc(tmp_path, INSTANCE)
    assert open_connections(proc, 8080, INSTANCE_PID) == 2
    assert open_connections(proc, 8081, INSTANCE_PID) == 0
    assert ProcReader(tmp_path).open_connections(8080, INSTANCE_PID) == 2


def test_another_users_connections_on_the_instances_port_do_not_hold_it_up(tmp_path: Path) -> None:
    proc = _proc(tmp_path, INSTANCE[:1] + ATTACK)
    assert open_connections(proc, 8080, INSTANCE_PID) == 0
    proc = _proc(tmp_path / "both", INSTANCE + ATTACK)
    assert open_connections(proc, 8080, INSTANCE_PID) == 2


def test_a_wildcard_listener_accepts_at_every_address_of_its_family(tmp_path: Path) -> None:
    rows = [_row(0, "00000000:1F90", "00000000:0000", "0A", INSTANCE_UID),
            _row(1, "0200007F:1F90", "0100007F:D920", "01", INSTANCE_UID),
            _row(2, "0300007F:1F90", "0100007F:D926", "01", 65534)]
    # [::]:8080 takes IPv4 clients as ::ffff:a.b.c.d (IPv6 sockets): not the IPv4 listener's.
    tcp6 = (_row(3, "0000000000000000FFFF00000100007F:1F90", "0000000000000000FFFF00000100007F:D940", "01",
                 INSTANCE_UID),)
    assert open_connections(_proc(tmp_path, rows, tcp6), 8080, INSTANCE_PID) == 1


def test_a_gone_instance_has_no_connections(tmp_path: Path) -> None:
    proc = _proc(tmp_path, INSTANCE)
    assert open_connections(proc, 8080, INSTANCE_PID + 1) == 0
