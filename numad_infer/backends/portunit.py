"""numa-infer-port.socket, the shipped unit through which systemd holds the front door's port
from boot (listener.py says why): its addresses kept in step with frontend.listen, and the
port handed back to it when the daemon stops for good on a socket it bound itself.

Why not restart the socket unit on a new frontend.listen and use its socket at once:
systemd passes a socket unit's descriptors to a service only when it starts the service,
so a running daemon would never get the new one. So on a new address the daemon binds its
own socket (its file descriptor store keeps it across restarts), and the drop-in written
here gives the address to the unit, which binds it from its next start: the next boot,
or the daemon's next real stop. Then the daemon lends its socket (SO_REUSEPORT, which
Linux grants to sockets of the same owner only, root here), the unit binds the address
beside it, and only then does the daemon let go: the port is never free in between.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from numad_infer.config.schema import Config
from numad_infer.frontdoor.listener import HeldListener
from numad_infer.systemd.systemctl import Systemctl, SystemctlError
from numad_infer.systemd.unitdir import check_private_dir
from numad_infer.systemd.unitnames import PORT_DROPIN, PORT_HOLD, PORT_SOCKET, UNIT_MARKER
from numad_infer.units.render import port_listens, render_port_dropin
from numad_infer.util.addresses import host_port
from numad_infer.util.atomicfile import write_atomic

log = logging.getLogger(__name__)

# Read at boot: not the unit directory (/run/systemd/system by default, emptied by a reboot).
PORT_DROPIN_DIR = "/etc/systemd/system"


class PortUnit:
    def __init__(self, systemctl: Systemctl, unit_dir: Path = Path(PORT_DROPIN_DIR)) -> None:
        self.systemctl = systemctl
        self.path = unit_dir / PORT_DROPIN
        self._told_off = False

    def installed(self) -> bool:
        try:
            shown = self.systemctl.show_many([PORT_SOCKET], "LoadState")
        except SystemctlError:
            return False
        return shown.get(PORT_SOCKET, {}).get("LoadState") == "loaded"

    def sync(self, config: Config) -> bool:
        """Bring the drop-in to frontend.listen. True when it changed: a daemon-reload is
        due (systemd then drops the unit's socket on the old address). Nothing where the
        unit is not installed (a source install without it)."""
        installed = self.installed()
        text = render_port_dropin(config) if installed else None
        try:
            current: str | None = self.path.read_text(encoding="utf-8")
        except OSError:
            current = None
        if installed and not config.frontend.enabled and not self._told_off:
            self._told_off = True
            log.info("port: the front door is off; %s still holds its port: `systemctl disable --now %s` frees it",
                     PORT_SOCKET, PORT_SOCKET)
        if current == text:
            return False
        if current is not None and not current.startswith(UNIT_MARKER + "\n"):
            log.warning("port: %s was not written by numa-infer: left as it is, and %s keeps its addresses",
                        self.path, PORT_SOCKET)
            return False
        if text is None:
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()  # only if empty: an operator's own drop-ins stay
            log.info("port: removed %s: %s holds the addresses it ships with from its next start", self.path,
                     PORT_SOCKET)
            return True
        check_private_dir(self.path.parent)  # as root: never through a planted link
        write_atomic(self.path, text)
        log.info("port: wrote %s: %s holds %s from its next start", self.path, PORT_SOCKET,
                 ", ".join(port_listens(config)))
        return True

    def take_over(self, listener: HeldListener) -> None:
        """The daemon stops for good: the unit binds the addresses of the sockets the daemon
        bound itself, beside them, before the daemon lets go of them."""
        own = [held for held in listener.held() if not held.from_unit]
        if not own or not self.installed():
            return
        listener.refuse()  # not listening while both are bound: the unit's socket gets every connection
        lent = ", ".join(host_port(*address) for address in listener.lend())
        try:
            # systemd refuses to start a socket whose service is active: the no-op it "activates".
            self.systemctl.stop(PORT_HOLD)
            # At once: ordered before the daemon, a plain restart would wait for this very stop.
            self.systemctl.run("restart", "--job-mode=ignore-dependencies", "--", PORT_SOCKET)
        except SystemctlError as exc:
            log.warning("port: %s did not take over %s (%s): the port is free from the daemon's exit until the unit "
                        "starts again", PORT_SOCKET, lent, exc)
            return
        log.info("port: %s holds %s now; the daemon lets go of its own socket", PORT_SOCKET, lent)
