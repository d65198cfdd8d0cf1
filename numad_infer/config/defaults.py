"""Default locations and stop timeouts. Kept apart so light commands (status) need not import the config schema."""

DEFAULT_CONFIG_PATH = "/etc/numa-infer.toml"
# The daemon's RuntimeDirectory (packaging/systemd/numa-infer.service): its state file, and
# the front door's haproxy.cfg and listener handout (units/render.py).
RUN_DIR = "/run/numa-infer"
DEFAULT_STATE_FILE = f"{RUN_DIR}/state.json"

# How long a stop waits before SIGKILL: every instance at once (the process backend's wait,
# the instance units' TimeoutStopSec under systemd: units/render.py), then the
# front door's HAProxy. With frontend.drain_timeout_s they bound a daemon's exit after
# SIGTERM (stop_bound_s); deploy/kubernetes's terminationGracePeriodSeconds covers it.
INSTANCE_STOP_S = 30.0
FRONTDOOR_STOP_S = 10.0


def stop_bound_s(drain_timeout_s: float) -> float:
    """The longest a daemon takes from SIGTERM to exit: the drain, the instances, HAProxy."""
    return drain_timeout_s + INSTANCE_STOP_S + FRONTDOOR_STOP_S

# The system users the package makes (debian/numa-infer.sysusers, installed as
# SYSUSERS_FILE): the servers under the process backend, and HAProxy under both backends.
INSTANCE_USER = "numa-infer"
FRONTDOOR_USER = "numa-infer-frontdoor"
SYSUSERS_FILE = "/usr/lib/sysusers.d/numa-infer.conf"

# Under systemd, the instances' saved prompt caches (supervision/slot_keeper.py): the
# daemon's StateDirectory= (packaging/systemd/numa-infer.service), one directory an
# instance, root's and the group SLOTS_GROUP's, mode 770. The instances' units join that
# group (units/render.py): a DynamicUser owns no file the daemon could otherwise read.
SLOTS_DIR = "/var/lib/numa-infer/slots"
SLOTS_GROUP = INSTANCE_USER
