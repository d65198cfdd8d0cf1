"""Plan -> systemd unit text. Pure: one template plus one drop-in per instance.

Every value that reaches a unit file goes through `quote_arg`/`escape_value`, which
apply systemd's rules (systemd.syntax(7), systemd.service(5) "Command lines",
systemd.unit(5) "Specifiers"): `%` -> `%%`, `$` -> `$$` in command lines, and each
argument double-quoted with `\\` and `"` escaped. Control characters never get here:
the config rejects them, and `quote_arg` refuses them again as a last line of defence.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from pathlib import Path

from numad_infer.config.defaults import FRONTDOOR_STOP_S, FRONTDOOR_USER, INSTANCE_STOP_S, RUN_DIR, SLOTS_DIR
from numad_infer.config.models import ServedModel
from numad_infer.config.schema import Config
from numad_infer.engines import KEY_CREDENTIAL, Engine
from numad_infer.engines.launch import Launch, launches
from numad_infer.engines.slot_names import gives_slot_path, slot_directory
from numad_infer.errors import NumaInferError
from numad_infer.frontdoor.haproxy_config import CONFIG_NAME
from numad_infer.plan.model import Instance, Plan
from numad_infer.systemd.unitnames import FRONTDOOR_UNIT, PORT_SOCKET, UNIT_MARKER, dropin, template_unit
from numad_infer.util.addresses import connect_host, host_port, loopback_twin
from numad_infer.util.cpuset import format_list

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class RenderError(NumaInferError, ValueError):
    """A value no unit file may hold (the config refuses it first; this is the last line of defence)."""


def escape_value(text: str) -> str:
    """A value in a directive other than a command line: only specifiers are special."""
    if _CONTROL.search(text):
        raise RenderError(f"control character in unit value {text!r}")
    return text.replace("%", "%%")


def quote_arg(arg: str, command_line: bool = True) -> str:
    """One argument, double-quoted so spaces, quotes and `;` stay inside it.

    `$` is special only in command lines (variable expansion, `$$` for a literal one);
    in `Environment=` systemd keeps `$$` as two characters.
    """
    if _CONTROL.search(arg):
        raise RenderError(f"control character in command argument {arg!r}")
    inner = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    if command_line:
        inner = inner.replace("$", "$$")
    return f'"{inner}"'


# The sandbox every unit numa-infer renders shares (instances and the front door): no
# capabilities, nothing writable but a private /tmp, no view of other users' processes.
SANDBOX = (
    "CapabilityBoundingSet=",
    "AmbientCapabilities=",
    "NoNewPrivileges=yes",
    "ProtectSystem=strict",
    "PrivateTmp=yes",
    "PrivateDevices=yes",
    "PrivateMounts=yes",
    "PrivateUsers=yes",
    "ProtectKernelTunables=yes",
    "ProtectKernelModules=yes",
    "ProtectKernelLogs=yes",
    "ProtectControlGroups=yes",
    "ProtectClock=yes",
    "ProtectHostname=yes",
    "ProtectProc=invisible",
    "RestrictNamespaces=yes",
    "RestrictSUIDSGID=yes",
    "LockPersonality=yes",
    "RestrictRealtime=yes",
    "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
    "SystemCallArchitectures=native",
    "UMask=0077",
)


def ip_allow_list(host: str) -> list[str]:
    """Loopback only while the listen address is loopback (the default): the server then
    cannot talk to, or be reached from, anything else."""
    if ipaddress.ip_address(host).is_loopback:
        return ["IPAddressDeny=any", "IPAddressAllow=localhost"]
    return []


def frontdoor_ip_allow_list(config: Config) -> list[str]:
    """A loopback front door talks to its clients on loopback, and to the instances where
    they listen: `server.host` may be another address of this machine (10.1.2.3), and
    without it in the allow list every server went DOWN and every request got a 503."""
    rules = ip_allow_list(config.frontend.address[0])
    instances = connect_host(config.server.host)
    if rules and not ipaddress.ip_address(instances).is_loopback:
        rules[-1] += f" {instances}"
    return rules


def render_template(config: Config, engine: Engine, served: tuple[ServedModel, ...],
                    slots_group: str | None = None) -> str:
    """`slots_group`: the group that owns the saved prompt caches' directories (identity.
    systemd_slots_group); None: the instances keep none."""
    lines = [
        UNIT_MARKER,
        "[Unit]",
        "Description=numa-infer llama.cpp server %i",
        # No PartOf=numa-infer.service: systemd would pass a daemon restart (an upgrade)
        # on to every instance; the daemon stops them itself on a real stop.
        "After=network.target",
        "",
        "[Service]",
        "Type=exec",
        "Restart=on-failure",
        "RestartSec=2",
        f"TimeoutStopSec={INSTANCE_STOP_S:g}",  # what stop_bound_s counts
        # Unprivileged and read-only: the server only reads the model and listens.
        "DynamicUser=yes",
        *(SANDBOX if slots_group is None else _sandbox_keeping_slots(slots_group)),
        "ProtectHome=read-only",
        # OpenMP pins its threads (sched_setaffinity, in @resources): @system-service keeps it.
        "SystemCallFilter=@system-service",
        "SystemCallErrorNumber=EPERM",
        *ip_allow_list(config.server.host),
        "Environment=HOME=/tmp",
        "Environment=PYTHONUNBUFFERED=1",
    ]
    if any(m.view.model.mlock for m in served):  # allowed here, asked per model (argv)
        lines.append("LimitMEMLOCK=infinity")
    if config.server.api_key_file:
        lines.append(f"LoadCredential={KEY_CREDENTIAL}:{escape_value(config.server.api_key_file)}")
        # %d: the service's credentials directory (a specifier, so not escaped).
        lines += [f"Environment={name}={value}" for name, value in engine.credential_environment().items()]
    return "\n".join(lines) + "\n"


def _sandbox_keeping_slots(group: str) -> list[str]:
    """SANDBOX, for a server that saves its slots into its directory under SLOTS_DIR (root's
    and `group`'s, mode 770, so no one else reaches in): it joins the group, and its files
    are readable by the daemon, which is root without CAP_DAC_* and reads them to check a
    restore (slot_keeper.py). A DynamicUser's own group is no use: its gid is allocated at
    each start, and the daemon is not in it."""
    return [f"SupplementaryGroups={escape_value(group)}",
            *("UMask=0022" if line.startswith("UMask=") else line for line in SANDBOX)]


def slot_save_arguments(engine: Engine, instance: Instance, launch: Launch, slots: bool) -> tuple[str, ...]:
    """The engine's --slot-save-path under systemd: the instance's directory under SLOTS_DIR,
    which the daemon makes before the unit starts (backends/systemd.py). None where the
    instances keep no cache, the engine has no such option, or the operator named one."""
    option = engine.slot_save_option
    if not slots or option is None or not gives_slot_path(option, launch.unit_argv):
        return ()
    return option, f"{slot_directory(Path(SLOTS_DIR), instance.name)}/"


def _slot_mounts(slot_save: tuple[str, ...]) -> list[str]:
    """The instance's own directory of saved slots, the one place it may write, and the only
    one of SLOTS_DIR it sees: an empty read-only tmpfs over SLOTS_DIR, its own directory
    bound back into it. Another instance's conversations stay out of its reach (all the
    servers are in the group), and SLOTS_DIR itself is root's, mode 700, so no process
    outside the units reaches any. "-": a directory missing is the server's own error to
    say ("not a directory")."""
    if not slot_save:
        return []
    own = escape_value(slot_save[-1].rstrip("/"))
    return [f"TemporaryFileSystem={escape_value(SLOTS_DIR)}:ro", f"BindPaths=-{own}", f"ReadWritePaths=-{own}"]


def render_dropin(instance: Instance, launch: Launch, slot_save: tuple[str, ...] = ()) -> str:
    """`slot_save`: slot_save_arguments' (the path is also the one place it may write)."""
    env = " ".join(quote_arg(f"{k}={v}", command_line=False) for k, v in launch.environment)
    lines = [
        UNIT_MARKER,
        f"# {instance.name}: node {instance.node if instance.node is not None else 'interleave'}, "
        f"CPUs {format_list(instance.cpus)}, memory {format_list(instance.mems)}, port {instance.port}",
        "[Service]",
        f"CPUAffinity={' '.join(str(c) for c in instance.cpus)}",
        f"NUMAPolicy={instance.policy.value}",
        f"NUMAMask={format_list(instance.mems)}",
        f"Environment={env}",
        *_slot_mounts(slot_save),
        "ExecStart=" + " ".join(quote_arg(a) for a in (*launch.unit_argv, *slot_save)),
    ]
    return "\n".join(lines) + "\n"


# Where the front door's unit finds its files (the daemon writes the config into
# its own RuntimeDirectory, kept across daemon restarts; HAProxy owns the socket's).
FRONTDOOR_RUN_DIR = RUN_DIR
FRONTDOOR_SOCKET = "/run/numa-infer-frontdoor/admin.sock"
# Where the daemon hands its listening socket to HAProxy's unit (listener.Handout); in its
# own RuntimeDirectory, group numa-infer-frontdoor, mode 0660.
FRONTDOOR_HANDOUT = f"{RUN_DIR}/listener.sock"


def frontdoor_identity(user: str | None) -> list[str]:
    """Who HAProxy runs as under systemd, and its admin socket's directory (mode 0750).

    `user` (identity.FRONTDOOR_USER, made by the package): its own user and group. The
    socket (mode 660) is then the group's too, and the daemon, which has no DAC override,
    reaches it as a member (SupplementaryGroups= in numa-infer.service). No one else is.
    Not a DynamicUser: the daemon could not be in its group.
    None (the user is missing, a source install): root with no capability at all, as
    before the user existed; the socket is then root's, which the daemon is.
    """
    directory = ["RuntimeDirectory=numa-infer-frontdoor", "RuntimeDirectoryMode=0750"]
    if user is None:
        return directory
    return [f"User={escape_value(user)}", f"Group={escape_value(user)}", *directory]


def render_frontdoor_unit(config: Config, user: str | None = FRONTDOOR_USER, python: str | None = None) -> str:
    """`python`: the interpreter that runs frontdoor_exec (default: the daemon's own, which
    can import numad_infer wherever it was installed)."""
    binary = config.frontend.haproxy
    cfg = f"{FRONTDOOR_RUN_DIR}/{CONFIG_NAME}"
    # HAProxy, and its check, start on the socket the daemon holds (listener.py says why):
    # frontdoor_exec asks the daemon for it, then executes HAProxy in its own place.
    on_socket = (python or sys.executable, "-m", "numad_infer.frontdoor_exec", FRONTDOOR_HANDOUT, "--", binary)
    # Not -q: it silences the alerts too, and the journal would say only that the check failed.
    check = " ".join(quote_arg(a) for a in (*on_socket, "-c", "-f", cfg))
    lines = [
        UNIT_MARKER,
        "[Unit]",
        "Description=numa-infer front door: one OpenAI endpoint over the llama.cpp instances (HAProxy)",
        "Documentation=man:numa-infer(8) man:haproxy(1)",
        # Not PartOf=numa-infer.service: a daemon restart or upgrade must not drop a connection.
        "After=network.target",
        "",
        "[Service]",
        # -Ws: master-worker with sd_notify; SIGUSR2 to the master reloads without
        # dropping a connection (the new workers take over the listening socket).
        "Type=notify",
        "ExecStartPre=" + check,
        "ExecStart=" + " ".join(quote_arg(a) for a in (*on_socket, "-Ws", "-f", cfg)),
        "ExecReload=" + check,
        "ExecReload=/bin/kill -USR2 $MAINPID",
        "KillMode=mixed",
        # A stop is HAProxy's soft stop: the master passes SIGUSR1 to its workers, which stop
        # accepting (systemd's socket keeps the port's backlog), finish the requests they carry
        # and exit; SIGTERM would cut them. Bounded as the daemon bounds its own drain.
        "KillSignal=SIGUSR1",
        f"TimeoutStopSec={config.frontend.drain_timeout_s + FRONTDOOR_STOP_S:g}",
        "Restart=on-failure",
        "RestartSec=2",
        *frontdoor_identity(user),
        *SANDBOX,
        "ProtectHome=yes",
        "SystemCallFilter=@system-service",
        "SystemCallErrorNumber=EPERM",
        *frontdoor_ip_allow_list(config),
    ]
    # No capability even for a port below 1024: the daemon binds it (CAP_NET_BIND_SERVICE
    # in numa-infer.service), HAProxy only accepts on it.
    return "\n".join(lines) + "\n"


# numa-infer-port.socket's own ListenStream= lines (packaging/systemd/): frontend.listen's
# default and its loopback twin, which need no drop-in (tests/units hold the two together).
SHIPPED_PORT_LISTENS = ("127.0.0.1:8000", "[::1]:8000")


def port_listens(config: Config) -> tuple[str, ...]:
    """Where systemd holds the front door's port: frontend.listen and its loopback twin."""
    host, port = config.frontend.address
    twin = loopback_twin(host)
    return tuple(host_port(h, port) for h in (host, *([twin] if twin else [])))


def render_port_dropin(config: Config) -> str | None:
    """numa-infer-port.socket's drop-in: frontend.listen's addresses in place of the shipped
    ones. None where it needs none: the default, or no front door (the unit then holds the
    default port until it is disabled, which the daemon leaves to the operator)."""
    if not config.frontend.enabled or set(port_listens(config)) == set(SHIPPED_PORT_LISTENS):
        return None
    lines = [
        UNIT_MARKER,
        f"# frontend.listen = \"{escape_value(config.frontend.listen)}\": held by systemd from boot ({PORT_SOCKET})",
        "[Socket]",
        "ListenStream=",  # empty: the shipped addresses go
        *(f"ListenStream={escape_value(listen)}" for listen in port_listens(config)),
    ]
    return "\n".join(lines) + "\n"


def render_units(config: Config, plan: Plan, frontdoor_user: str | None = FRONTDOOR_USER,
                 python: str | None = None, *, served: tuple[ServedModel, ...], engine: Engine,
                 launched: dict[str, Launch] | None = None, slots_group: str | None = None) -> dict[str, str]:
    """Relative path under the unit directory -> file content. `frontdoor_user`: see
    `frontdoor_identity` (identity.systemd_frontdoor_user says which this host has);
    `slots_group`: see `render_template` (identity.systemd_slots_group).
    `served`, `engine`: the models and engine the one load worked out (validate/pipeline.py);
    `launched`: the launches it worked out from them (None: worked out here, from `served` and `engine`)."""
    starts = launched if launched is not None else launches(engine, served, plan)
    template = config.systemd.template
    slot_saves = {i.name: slot_save_arguments(engine, i, starts[i.name], slots_group is not None)
                  for i in plan.instances}
    # The group and the looser umask only where a server saves there.
    keeping = slots_group if any(slot_saves.values()) else None
    files = {template_unit(template): render_template(config, engine, served, keeping)}
    if config.frontend.enabled:
        files[FRONTDOOR_UNIT] = render_frontdoor_unit(config, frontdoor_user, python)
    for instance in plan.instances:
        files[dropin(instance.name)] = render_dropin(instance, starts[instance.name], slot_saves[instance.name])
    return files
