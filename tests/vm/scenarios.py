#!/usr/bin/env python3
"""End-to-end scenarios inside the QEMU guest: real systemd, emulated NUMA nodes.

Runs as root in the guest (tests/vm/run_suite.py puts it there). Standard library only:
what it checks it reads itself (sysfs, /proc/PID/numa_maps, systemctl, HTTP), so it
does not take numa-infer's word for anything. Prints one `PASS name (timings)` or
`FAIL name: what was seen` line per scenario.
"""

from __future__ import annotations

import grp
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path

CONFIG = Path("/etc/numa-infer.toml")
MODEL = "/var/lib/numa-infer/models/tiny.gguf"
NI = "/opt/llm/bin/numa-infer"  # the "deb" group switches to the packaged /usr/bin/numa-infer
RESULTS: list[str] = []


class Fail(Exception):
    pass


def sh(*args: str, check: bool = True, timeout: float = 120) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise Fail(f"{' '.join(args)} -> {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return proc.stdout


# The "engine" group installs scripts/build-llama-server's directory from the share, as the
# container image does: the binary with its libraries and CPU variants beside it.
LLAMA_SERVER_DIR = "/usr/local/lib/llama-server"
LLAMA_SERVER = f"{LLAMA_SERVER_DIR}/llama-server"
ENGINE = "llama-cpp-python"  # the "engine" group switches to "llama-server"
ENGINE_KEYS = {"llama-cpp-python": 'engine = "llama-cpp-python"\npython = "/opt/llm/bin/python"\n',
               "llama-server": f'engine = "llama-server"\nllama_server = "{LLAMA_SERVER}"\nparallel = 2\n'}
SERVER_PROCESS = {"llama-cpp-python": "llama_cpp.server", "llama-server": "llama-server"}


def write_config(placement: str = "", server_extra: str = "", frontend: str = "", context_size: int = 256) -> None:
    CONFIG.write_text(
        f'[model]\npath = "{MODEL}"\ncontext_size = {context_size}\n'
        f"[placement]\n{placement}\n"
        f'[server]\n{ENGINE_KEYS[ENGINE]}{server_extra}\n'
        # TCG runs ~15x slower than the host: generous timeouts, short interval.
        "[monitor]\ninterval_s = 2.0\nstartup_grace_s = 240\nmax_restarts = 10\n"
        "[tuning]\nprobe_timeout_s = 5.0\nunhealthy_after = 2\nrestart_backoff_s = 1.0\n"
        f"[frontend]\n{frontend}\n"
    )


def status() -> dict:
    out = subprocess.run([NI, "status", "--json"], capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)


def inst(state: dict, name: str) -> dict:
    for i in state["instances"]:
        if i["name"] == name:
            return i
    raise Fail(f"{name} missing from status: {[i['name'] for i in state['instances']]}")


def wait(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except (Fail, ValueError, KeyError, OSError, subprocess.TimeoutExpired) as exc:
            last = exc
        time.sleep(interval)
    raise Fail(f"timed out after {timeout:.0f}s waiting for {what} (last: {str(last)[:300]})")


def all_healthy(count: int, timeout: float = 300) -> dict:
    def check():
        s = status()
        return s if len(s["instances"]) == count and all(i["state"] == "healthy" for i in s["instances"]) else None
    return wait(check, timeout, f"{count} healthy instances")


def main_pid(unit: str) -> int:
    return int(sh("systemctl", "show", "-p", "MainPID", "--value", unit).strip() or 0)


def cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def node_cpus(node: int) -> set[int]:
    return cpulist(Path(f"/sys/devices/system/node/node{node}/cpulist").read_text())


def thread_masks(pid: int) -> dict[int, set[int]]:
    masks = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status_text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        masks[int(tid)] = cpulist(re.search(r"Cpus_allowed_list:\s*(\S+)", status_text).group(1))
    return masks


def locality(pid: int, node: int) -> tuple[float, float, int]:
    """(anonymous fraction on node, page-cache fraction on node, anon bytes) from numa_maps."""
    anon = {}
    files = {}
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        nodes = [(int(n), int(p)) for n, p in re.findall(r"\bN(\d+)=(\d+)", line)]
        if not nodes:
            continue
        page = int(m.group(1)) * 1024 if (m := re.search(r"kernelpagesize_kB=(\d+)", line)) else 4096
        a = re.search(r"\banon=(\d+)", line)
        is_anon = " file=" not in line or (a is not None and int(a.group(1)) >= sum(p for _, p in nodes))
        target = anon if is_anon else files
        for n, p in nodes:
            target[n] = target.get(n, 0) + p * page
    total, ftotal = sum(anon.values()), sum(files.values())
    return (anon.get(node, 0) / total if total else 0.0, files.get(node, 0) / ftotal if ftotal else 0.0, total)


FRONT_PORT = 8000  # frontend.listen's default
# Where the front door listens by default: frontend.listen and its loopback twin (`localhost`
# is ::1 first for most clients), and the wildcards that would cover them.
FRONT_ADDRESSES = (f"127.0.0.1:{FRONT_PORT}", f"[::1]:{FRONT_PORT}")
WILDCARDS = (f"0.0.0.0:{FRONT_PORT}", f"[::]:{FRONT_PORT}")
PORT_SOCKET = "numa-infer-port.socket"
PORT_DROPIN = Path("/etc/systemd/system/numa-infer-port.socket.d/50-numa-infer.conf")

# Another local user taking the front door's port: it would get the clients and their API
# keys. Binds every address over and over (SO_REUSEADDR on; SO_REUSEPORT too, the second
# time), and lets go at once; prints each address it got. With a probe list: each time it
# gets an address, it tries those too, and says GAP for any it gets (a new frontend.listen
# still free while the old one already was).
SQUAT = r"""
import errno, json, signal, socket, sys, time
seconds, watched, probes = json.loads(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

def take(address, reuse_port):
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            s.bind((host, int(port)))
            s.listen(1)
            return "BOUND"
        except OSError as exc:
            return errno.errorcode.get(exc.errno, str(exc.errno))

tries, until = 0, time.monotonic() + seconds
try:
    while True:
        for address in watched:
            for reuse_port in (False, True):
                tries += 1
                got = take(address, reuse_port)
                if got != "EADDRINUSE":
                    print(got, address, flush=True)
                if got == "BOUND":
                    for probe in probes:
                        if take(probe, False) == "BOUND":
                            print("GAP", probe, "was free when", address, "was taken", flush=True)
        if time.monotonic() >= until:
            break
        time.sleep(0.05)  # a light load: under TCG the instances share the vCPUs with it
finally:
    print("TRIES", tries, flush=True)
"""


def _squatter(seconds: float, watched: tuple[str, ...], probes: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    return subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "python3", "-c", SQUAT,
                             json.dumps([seconds, list(watched), list(probes)])],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/")


def squat_once(*addresses: str) -> list[str]:
    """What another user gets binding each address now, but EADDRINUSE (held): [] when held."""
    out, _ = _squatter(0, addresses).communicate(timeout=60)
    if "TRIES" not in out:
        raise Fail(f"the squatter did not run: {out[-300:]}")
    return [line for line in out.splitlines() if not line.startswith("TRIES")]


class Squatter:
    """`squat_once` over and over while something happens (a restart, a listen change)."""

    def __init__(self, *watched: str, probes: tuple[str, ...] = ()) -> None:
        self.watched, self.probes = watched, probes

    def __enter__(self) -> "Squatter":
        self.proc = _squatter(900, self.watched, self.probes)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.out, _ = self.proc.communicate(timeout=60)

    def verdict(self, what: str, allowed: tuple[str, ...] = ()) -> str:
        """None of the watched addresses taken (but those in `allowed`), and no GAP."""
        lines = self.out.splitlines()
        tries = next((int(l.split()[1]) for l in lines if l.startswith("TRIES")), 0)
        bad = [l for l in lines if not l.startswith("TRIES") and (l.startswith("GAP") or l.split()[1] not in allowed)]
        if bad or tries == 0:
            raise Fail(f"during {what}, another user (nobody) got: {bad[:5]} ({tries} tries)")
        return f"{tries} binds as nobody during {what}, none got the port"


def holders(port: int) -> list[str]:
    """`ss` lines of the sockets listening on `port`, with their processes."""
    return [l for l in sh("ss", "-Hltnp", f"sport = :{port}", check=False).splitlines() if "LISTEN" in l]


def port_held_by_systemd_alone(what: str) -> str:
    """After the daemon is gone: no other user binds the front door's addresses (nor the
    wildcards over them), systemd (PID 1) alone holds them, and its socket unit is fine."""
    got = squat_once(*FRONT_ADDRESSES, *WILDCARDS)
    if got:
        raise Fail(f"{what}: another user (nobody) binding the front door's port got {got}")
    lines = holders(FRONT_PORT)
    if len(lines) != 2 or any("pid=1," not in l or l.count("pid=") != 1 for l in lines):
        raise Fail(f"{what}: the port is not held by systemd alone: {lines}")
    if sh("systemctl", "is-active", PORT_SOCKET, check=False).strip() != "active":
        raise Fail(f"{what}: {PORT_SOCKET} is {sh('systemctl', 'is-active', PORT_SOCKET, check=False).strip()}")
    return f"{', '.join(FRONT_ADDRESSES)} held by systemd alone, no other user binds them (wildcards included)"


class Load:
    """Clients sending completions through the front door until stopped (bounded: at most
    `limit` requests each, each within 300 s); every outcome is kept."""

    def __init__(self, clients: int = 2, limit: int = 300) -> None:
        import threading
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(limit, f"numa client {n}"), daemon=True)
                        for n in range(clients)]

    def _client(self, limit: int, prompt: str) -> None:
        # Each client its own prompt, as each user has their own conversation: under the
        # default prefix routing the clients' keys find homes on different instances
        # (1b-frontdoor counts requests on both nodes), where one shared prompt would be one
        # key kept on one instance within the load bound.
        for _ in range(limit):
            if self._stop.is_set():
                return
            try:
                complete(FRONT_PORT, timeout=300, prompt=prompt)
                with self._lock:
                    self.ok += 1
            except Exception as exc:  # every kind of failure counts
                with self._lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(330)

    def verdict(self, what: str) -> str:
        if self.failures or self.ok == 0:
            raise Fail(f"during {what}: {self.ok} requests ok, {len(self.failures)} failed: {self.failures[:3]}")
        return f"{self.ok} requests through the front door during {what}, 0 failed"


def under_load(action, what: str):
    """Run `action` while clients use the front door; no request may fail."""
    with Load() as load:
        time.sleep(3)  # requests in flight before the action
        result = action()
        time.sleep(3)  # and after it
    return result, load.verdict(what)


def complete(port: int, timeout: float = 120, prompt: str = "numa") -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                 data=json.dumps({"prompt": prompt, "max_tokens": 4}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)["choices"][0]["text"]


def journal_since(cursor_time: str) -> str:
    return sh("journalctl", "-u", "numa-infer", "--since", cursor_time, "--no-pager", "-o", "cat", check=False)


def now_str() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def scenario(name: str):
    def decorate(fn):
        def run():
            started = time.monotonic()
            try:
                detail = fn() or ""
                RESULTS.append(f"PASS {name} ({detail}{'; ' if detail else ''}{time.monotonic() - started:.1f}s)")
            except Fail as exc:
                RESULTS.append(f"FAIL {name}: {exc}")
            except Exception as exc:  # a bug in the scenario is a failure too, with its trace
                RESULTS.append(f"FAIL {name}: {type(exc).__name__}: {exc}")
                traceback.print_exc()
            print(RESULTS[-1], flush=True)
            if RESULTS[-1].startswith("FAIL"):
                # What the daemon and the front door said meanwhile: the guest is gone after the run.
                since = f"-{int(time.monotonic() - started) + 5}s"
                journal = subprocess.run(["journalctl", "--no-pager", "-o", "short-monotonic", "--since", since,
                                          "-u", "numa-infer", "-u", "numa-infer-frontdoor"],
                                         capture_output=True, text=True, timeout=60).stdout
                print("  journal:\n" + "\n".join("    " + line for line in journal.splitlines()[-60:]), flush=True)
        run.scenario_name = name
        run.__wrapped__ = fn
        return run
    return decorate


# -- 2 nodes x 2 CPUs -------------------------------------------------------------------------

@scenario("1-start")
def s1_start() -> str:
    write_config()
    t0 = time.monotonic()
    sh("systemctl", "start", "numa-infer", timeout=300)
    state = all_healthy(2)
    took = time.monotonic() - t0
    notes = []
    for name, node in (("infer@0", 0), ("infer@1", 1)):
        if sh("systemctl", "is-active", name, check=False).strip() != "active":
            raise Fail(f"{name} not active")
        pid = main_pid(name)
        i = inst(state, name)
        if i["pid"] != pid:
            raise Fail(f"status says {name} pid {i['pid']}, systemd says {pid}")
        cpus = node_cpus(node)
        if set(i["cpus"]) != cpus:  # no SMT on this topology: every CPU of the node
            raise Fail(f"{name} cpus {i['cpus']} not node {node}'s {sorted(cpus)}")
        bad = {t: m for t, m in thread_masks(pid).items() if not m <= cpus}
        if bad:
            raise Fail(f"{name} threads outside node {node} CPUs {sorted(cpus)}: {bad}")
        anon_local, file_local, anon = wait(lambda: (l := locality(pid, node))[2] > 0 and l, 30, "anon memory")
        if anon_local < 0.95:
            raise Fail(f"{name}: only {anon_local:.1%} of {anon >> 20} MiB anonymous memory on node {node}")
        reported = wait(lambda: inst(status(), name)["local_memory_fraction"], 30, "status memory reading")
        if abs(reported - anon_local) > 0.05:
            raise Fail(f"{name}: status says {reported:.1%} local, numa_maps says {anon_local:.1%}")
        complete(i["port"])
        notes.append(f"{name} anon {anon_local:.1%} local ({anon >> 20} MiB), page cache {file_local:.1%} local apart")
    return f"all healthy {took:.1f}s after start; " + "; ".join(notes)


@scenario("1b-frontdoor")
def s1b_frontdoor() -> str:
    if sh("systemctl", "is-active", "numa-infer-frontdoor", check=False).strip() != "active":
        raise Fail("numa-infer-frontdoor.service is not active")
    user = frontdoor_runs_as_its_user()  # and the daemon's capabilities
    # Prefix routing is the default: the rendered front door picks an instance per key.
    # (The instances are infer-0 and infer-1 there; the surge server has a rule too.)
    picks = {line.split()[1] for line in Path("/run/numa-infer/haproxy.cfg").read_text().splitlines()
             if line.startswith("    use-server ")}
    if not {"infer-0", "infer-1"} <= picks:
        raise Fail(f"haproxy.cfg picks {sorted(picks)} per key, not both instances: prefix routing is off")
    before = {i["name"]: i.get("served") or 0 for i in status()["instances"]}
    load = Load(clients=2, limit=6)
    for t in load.threads:
        t.start()
    for t in load.threads:
        t.join(900)
    load.verdict("a burst")

    def both_served() -> dict | None:
        now = status()
        return now if all((i.get("served") or 0) > before[i["name"]] for i in now["instances"]) else None

    state = wait(both_served, 30, "requests counted on both nodes")
    front = state["frontdoor"]
    if not front or not front["up"]:
        raise Fail(f"status: front door {front}")
    served = {i["name"]: i["served"] - before[i["name"]] for i in state["instances"]}
    return (f"haproxy as {user}; prefix routing; {load.ok} requests through :{FRONT_PORT} from 2 clients, "
            f"served per node {served}")


@scenario("1c-api-key")
def s1c_api_key() -> str:
    """A key from a root-only file: the instances require it (a credential, never argv or a
    unit), clients through the front door send it, the daemon's probe keeps passing."""
    import urllib.error
    key = Path("/etc/numa-infer/api-key")
    key.parent.mkdir(exist_ok=True)
    key.write_text("vm-key-42\n")
    key.chmod(0o600)
    pids = {n: main_pid(n) for n in ("infer@0", "infer@1")}
    write_config(server_extra=f'api_key_file = "{key}"')
    sh(NI, "reload", timeout=300)
    wait(lambda: all(main_pid(n) not in (0, p) for n, p in pids.items()), 240, "instances restarted with the key")
    state = all_healthy(2)
    body = json.dumps({"prompt": "numa", "max_tokens": 4}).encode()

    def ask(port: int, headers: dict) -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST", data=body,
                                     headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    codes = {"direct, no key": ask(inst(state, "infer@0")["port"], {}), "front door, no key": ask(FRONT_PORT, {}),
             "front door, key": ask(FRONT_PORT, {"Authorization": "Bearer vm-key-42"})}
    if codes != {"direct, no key": 401, "front door, no key": 401, "front door, key": 200}:
        raise Fail(f"answers: {codes}")
    leaks = [str(p) for p in Path("/run/systemd/system").rglob("*") if p.is_file() and "vm-key-42" in p.read_text()]
    leaks += [n for n in ("infer@0", "infer@1") if b"vm-key-42" in Path(f"/proc/{main_pid(n)}/cmdline").read_bytes()]
    if leaks:
        raise Fail(f"the key is readable in {leaks}")
    time.sleep(6)
    state = status()
    if any(i["state"] != "healthy" or i["error"] for i in state["instances"]):
        raise Fail(f"not healthy with the key: {[(i['name'], i['state'], i['error']) for i in state['instances']]}")
    # Left on: only 9-stop follows it (GROUPS); a scenario after it would need the key.
    return f"answers {codes}; key in no unit file or argv; healthy"


@scenario("1d-tenants")
def s1d_tenants() -> str:
    """Tenants under systemd (issue 39), after 1c (the instances' key stays on): the key
    map HAProxy reads is root's, its group's (numa-infer-frontdoor) and mode 640; a tenant's
    key is served and the instances get theirs; a rotation is a reload that restarts no
    instance, while another tenant's requests run, none failing; then the tenants go again."""
    import stat
    import urllib.error
    keys = Path("/etc/numa-infer/tenants")
    keys.mkdir(mode=0o700, exist_ok=True)
    for name, key in (("a", "vm-tenant-a-1"), ("b", "vm-tenant-b-1")):
        (keys / name).write_text(key + "\n")
        (keys / name).chmod(0o600)
    instance_key = Path("/etc/numa-infer/api-key")
    tables = "".join(f'[[tenants]]\nname = "team-{n}"\nkey_file = "{keys / n}"\n' for n in ("a", "b"))
    pids = {n: main_pid(n) for n in ("infer@0", "infer@1")}
    write_config(server_extra=f'api_key_file = "{instance_key}"', frontend=tables)
    sh(NI, "reload", timeout=300)

    def ask(key: str | None) -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{FRONT_PORT}/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "numa", "max_tokens": 4}).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
        try:
            with urllib.request.urlopen(req, timeout=240) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    wait(lambda: ask("vm-tenant-a-1") == 200, 60, "team-a's key served")
    codes = {"no key": ask(None), "the instances' key": ask("vm-key-42"), "team-b": ask("vm-tenant-b-1")}
    if codes != {"no key": 401, "the instances' key": 401, "team-b": 200}:
        raise Fail(f"answers: {codes}")
    mapped = Path("/run/numa-infer/tenant-keys.map")
    info = mapped.stat()
    group = grp.getgrgid(info.st_gid).gr_name
    if (info.st_uid, group, stat.S_IMODE(info.st_mode)) != (0, "numa-infer-frontdoor", 0o640):
        raise Fail(f"{mapped}: uid {info.st_uid}, group {group}, mode {stat.S_IMODE(info.st_mode):o}")
    # Rotate team-a's key while team-b's requests run.
    done, results = threading.Event(), []

    def team_b() -> None:
        while not done.is_set():
            results.append(ask("vm-tenant-b-1"))

    client = threading.Thread(target=team_b)
    client.start()
    time.sleep(2)
    (keys / "a").write_text("vm-tenant-a-2\n")
    sh(NI, "reload", timeout=300)
    wait(lambda: ask("vm-tenant-a-2") == 200, 60, "team-a's new key served")
    old = ask("vm-tenant-a-1")
    time.sleep(2)
    done.set()
    client.join(300)
    failed = [c for c in results if c != 200]
    if old != 401 or failed or not results:
        raise Fail(f"after the rotation: the old key got {old}; team-b's requests {len(results)}, failed {failed[:3]}")
    if {n: main_pid(n) for n in pids} != pids:
        raise Fail(f"an instance restarted: {pids} -> { {n: main_pid(n) for n in pids} }")
    # The prefix keys' homes, saved for the reloaded HAProxy to read: team-b's prompt has one.
    homes = Path("/run/numa-infer/haproxy.homes")
    info = homes.stat()
    kept = [line.split() for line in homes.read_text().splitlines() if line.strip()]
    if ((info.st_uid, grp.getgrgid(info.st_gid).gr_name, stat.S_IMODE(info.st_mode)) != (0, group, 0o640)
            or not kept or any(len(words) != 3 for words in kept)):
        raise Fail(f"{homes}: uid {info.st_uid}, gid {info.st_gid}, mode {stat.S_IMODE(info.st_mode):o}, {kept[:3]}")
    leaks = [str(p) for p in (*Path("/run/systemd/system").rglob("*"), Path("/run/numa-infer/haproxy.cfg"))
             if p.is_file() and "vm-tenant-" in p.read_text(errors="replace")]
    if leaks or "vm-tenant-" in sh("journalctl", "--no-pager", "-o", "cat", "--since", "-10min", check=False):
        raise Fail(f"a tenant's key is readable in {leaks or 'the journal'}")
    # Its tokens, as the engine reported them in its answers, from HAProxy's
    # unit to the daemon's socket.
    def team_b_tokens() -> dict | None:
        found = [t for t in (status().get("frontdoor") or {}).get("tenants", []) if t["name"] == "team-b"]
        return found[0] if found and found[0]["counted_answers"] > len(results) // 2 else None

    used = wait(team_b_tokens, 60, "team-b's tokens in status")
    if not (used["prompt_tokens"] > 0 and 0 < used["completion_tokens"] <= 4 * used["counted_answers"]):
        raise Fail(f"team-b's tokens: {used}")
    write_config(server_extra=f'api_key_file = "{instance_key}"')  # 9-stop's load sends no tenant key
    sh(NI, "reload", timeout=300)
    wait(lambda: ask("vm-key-42") == 200, 60, "the front door without tenants")
    return (f"answers {codes}; {mapped.name} root:{group} 640; rotation: {len(results)} requests of team-b, 0 "
            f"failed, old key 401, no instance restarted, {len(kept)} prefix home(s) kept; no key in units, haproxy.cfg or the journal; team-b's "
            f"tokens {used['prompt_tokens']} prompt, {used['completion_tokens']} completion in "
            f"{used['counted_answers']} answers")


@scenario("2-kill-instance")
def s2_kill() -> str:
    before = inst(status(), "infer@1")
    t0 = time.monotonic()
    sh("systemctl", "kill", "-s", "KILL", "infer@1")
    state = wait(lambda: (s := status()) and (i := inst(s, "infer@1"))["state"] == "healthy"
                 and i["pid"] not in (None, before["pid"]) and i["restarts"] > before["restarts"] and s, 240, "infer@1 back")
    return f"healthy again after {time.monotonic() - t0:.1f}s, restarts {inst(state, 'infer@1')['restarts']}"


@scenario("3-hung-instance")
def s3_stop() -> str:
    pid = main_pid("infer@0")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    wait(lambda: inst(status(), "infer@0")["state"] in ("unhealthy",) or main_pid("infer@0") != pid, 120, "detection")
    detected = time.monotonic() - t0
    wait(lambda: (i := inst(status(), "infer@0"))["state"] == "healthy" and i["pid"] != pid, 240, "restart")
    return f"detected after {detected:.1f}s, healthy again after {time.monotonic() - t0:.1f}s"


@scenario("4-affinity-drift")
def s4_affinity() -> str:
    pid = main_pid("infer@1")
    tid = max(thread_masks(pid))
    wrong = ",".join(map(str, sorted(node_cpus(0))))
    since = now_str()
    t0 = time.monotonic()
    sh("taskset", "-p", "-c", wrong, str(tid))
    own = node_cpus(1)
    wait(lambda: thread_masks(pid).get(tid, own) <= own, 30, f"thread {tid} re-pinned", interval=0.1)
    took = time.monotonic() - t0
    repair = wait(lambda: (r := inst(status(), "infer@1")["last_repair"]) and r["kind"] == "affinity" and r, 20, "status repair")
    wait(lambda: "affinity drift" in journal_since(since), 20, "journal entry")
    return f"re-pinned after {took:.2f}s: {repair['detail']}"


@scenario("5-memory-drift")
def s5_memory() -> str:
    pid = main_pid("infer@1")
    t0 = time.monotonic()
    sh("migratepages", str(pid), "1", "0")
    after_move = locality(pid, 1)[0]
    # What the daemon promises is monitor.min_local_fraction (0.9 by default): a few pages
    # in use can refuse to move (seen once: 94.6% local, "78 page(s) could not move").
    wait(lambda: locality(pid, 1)[0] >= 0.9, 60, "pages back on node 1")
    took = time.monotonic() - t0
    repair = wait(lambda: (r := inst(status(), "infer@1")["last_repair"]) and r["kind"] == "memory" and r, 20, "status repair")
    return f"{after_move:.1%} local after migratepages, >=90% again after {took:.1f}s: {repair['detail']}"


@scenario("6-reload-drop-node")
def s6_reload() -> str:
    pid0 = main_pid("infer@0")
    write_config("nodes = [0]")
    sh("systemctl", "reload", "numa-infer", timeout=300)
    # The dropped instance is drained, not killed (issue 18): the reload takes it out of the
    # front door's rotation and the daemon stops it once no client connection to it is open,
    # on a later pass. So it is allowed to be active for a moment after the reload returns,
    # never past drain_timeout_s (120 s by default).
    t0 = time.monotonic()
    wait(lambda: sh("systemctl", "is-active", "infer@1", check=False).strip() != "active", 130,
         "infer@1 to be stopped after its drain")
    drained = time.monotonic() - t0
    if Path("/run/systemd/system/infer@1.service.d/50-numa-infer.conf").exists():
        raise Fail("infer@1 drop-in still there")
    if main_pid("infer@0") != pid0:
        raise Fail(f"infer@0 restarted: {pid0} -> {main_pid('infer@0')}")
    return f"infer@1 drained and stopped {drained:.1f}s after the reload returned, drop-in removed, infer@0 kept pid {pid0}"


@scenario("7-bad-reload")
def s7_bad_reload() -> str:
    pid0 = main_pid("infer@0")
    CONFIG.write_text(CONFIG.read_text().replace("nodes = [0]", "nodes = [0, 7]"))
    proc = subprocess.run(["systemctl", "reload", "numa-infer"], capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        raise Fail("systemctl reload succeeded on a broken config")
    if sh("systemctl", "is-active", "numa-infer", check=False).strip() != "active":
        raise Fail("daemon not active after bad reload")
    shown = sh("systemctl", "status", "numa-infer", "--no-pager", "-l", check=False)
    journal = sh("journalctl", "-u", "numa-infer", "--no-pager", "-o", "cat", "-n", "50", check=False)
    human = subprocess.run([NI, "status"], capture_output=True, text=True).stdout
    for where, text in (("systemctl status", shown), ("journal", journal), ("numa-infer status", human)):
        if "placement.nodes" not in text or str(CONFIG) not in text or "node 7 does not exist" not in text:
            raise Fail(f"{where} does not name file, key and problem:\n{text[-800:]}")
    if main_pid("infer@0") != pid0:
        raise Fail("infer@0 restarted by a failed reload")
    write_config()
    sh("systemctl", "reload", "numa-infer", timeout=300)
    all_healthy(2)
    return "old plan kept, error shown in systemctl status, journal and numa-infer status; fixed reload recovered"


@scenario("8-daemon-killed")
def s8_daemon_kill() -> str:
    with Squatter(*FRONT_ADDRESSES) as squat:
        pids, took = instances_survive(lambda: os.kill(main_pid("numa-infer"), signal.SIGKILL), "kill -9 of the daemon")
    return f"daemon back after {took:.1f}s, instances kept {pids}; {squat.verdict('the kill and restart')}"


def instances_survive(action, what: str) -> tuple[dict[str, int], float]:
    """Run `action` (something that replaces the daemon); every instance must keep its PID."""
    pids = {n: main_pid(n) for n in ("infer@0", "infer@1")}
    daemon = main_pid("numa-infer")
    t0 = time.monotonic()
    action()
    wait(lambda: main_pid("numa-infer") not in (0, daemon) and
         sh("systemctl", "is-active", "numa-infer", check=False).strip() == "active", 120, f"daemon back after {what}")
    state = all_healthy(2)
    after = {n: main_pid(n) for n in pids}
    if after != pids or any(inst(state, n)["pid"] != p for n, p in pids.items()):
        raise Fail(f"{what} restarted instances: {pids} -> {after}")
    return pids, time.monotonic() - t0


@scenario("8b-daemon-restart")
def s8b_daemon_restart() -> str:
    front = main_pid("numa-infer-frontdoor")
    with Squatter(*FRONT_ADDRESSES) as squat:
        (pids, took), load = under_load(
            lambda: instances_survive(lambda: sh("systemctl", "restart", "numa-infer", timeout=300),
                                      "systemctl restart"),
            "systemctl restart numa-infer")
    if main_pid("numa-infer-frontdoor") != front:
        raise Fail("the daemon restart restarted the front door")
    return f"restarted in {took:.1f}s, instances and front door kept {pids}; {load}; {squat.verdict('the restart')}"


@scenario("t1-tune")
def t1_tune() -> str:
    """numa-infer tune on the running fleet under systemd: each node's instance held (drained,
    stopped) while its node is measured, given back after; --apply edits and reloads."""
    before = {i["name"]: (i["restarts"], i["pid"]) for i in all_healthy(2)["instances"]}
    config_before = CONFIG.read_text()
    t0 = time.monotonic()
    proc = subprocess.run([NI, "tune", "--quick", "--nodes", "0,1", "--samples", "2", "--tokens", "6", "--json"],
                          capture_output=True, text=True, timeout=1500)
    if proc.returncode != 0:
        raise Fail(f"tune failed ({proc.returncode}): {proc.stderr[-600:]}")
    report = json.loads(proc.stdout)
    pairs = {(b["cpus_node"], b["memory_node"]) for b in report["bandwidth_gbs"]}
    if pairs != {(0, 0), (0, 1), (1, 0), (1, 1)}:
        raise Fail(f"bandwidth matrix has {sorted(pairs)}, not 2 x 2")
    threads = [c["threads"] for c in report["candidates"]]
    if threads != [2, 1]:
        raise Fail(f"candidates {threads}, expected [2, 1] on a 2-CPU node")
    journal = sh("journalctl", "-u", "numa-infer", "--no-pager", "-o", "cat", check=False)
    for name in ("infer@0", "infer@1"):
        if f"{name}: held by numa-infer tune" not in journal or f"{name}: released" not in journal:
            raise Fail(f"{name} was not held and released (journal)")
    state = all_healthy(2)
    restarts = {i["name"]: i["restarts"] for i in state["instances"]}
    if restarts != {n: r for n, (r, _) in before.items()}:
        raise Fail(f"holds counted as restarts: {before} -> {restarts}")
    took = time.monotonic() - t0
    applied = subprocess.run([NI, "tune", "--quick", "--samples", "2", "--tokens", "6", "--apply"],
                             capture_output=True, text=True, timeout=1500)
    if applied.returncode != 0:
        raise Fail(f"tune --apply failed ({applied.returncode}): {applied.stderr[-600:]}")
    all_healthy(2)
    changed = CONFIG.read_text() != config_before
    if changed and "reloaded:" not in applied.stdout:
        raise Fail(f"tune --apply changed the file but did not reload: {applied.stdout[-400:]}")
    write_config()  # the scenarios after this one expect the default settings
    sh("systemctl", "reload", "numa-infer", timeout=300)
    all_healthy(2)
    best = {c["key"]: (c["winner"], c["verdict"]) for c in report["choices"]}
    return (f"2x2 bandwidth matrix {[round(b['median'], 1) for b in report['bandwidth_gbs']]} GB/s (TCG); "
            f"candidates {threads}; choices {best}; {took:.0f}s with both nodes held in turn; "
            f"--apply {'changed and reloaded' if changed else 'kept the file'}")


@scenario("9-stop")
def s9_stop() -> str:
    sh("systemctl", "stop", "numa-infer", timeout=300)
    active = sh("systemctl", "list-units", "--plain", "--no-legend", "--state=active", "infer@*", check=False).strip()
    servers = sh("pgrep", "-af", SERVER_PROCESS[ENGINE], check=False).strip()
    front = sh("systemctl", "is-active", "numa-infer-frontdoor", check=False).strip()
    if active or servers or front == "active":
        raise Fail(f"left running: units {active!r}, processes {servers!r}, front door {front}")
    left = sorted(str(p) for p in Path("/run/systemd/system").glob("infer@*"))
    left += sorted(str(p) for p in Path("/run/systemd/system").glob("numa-infer-frontdoor*"))
    if left:
        raise Fail(f"rendered units left behind: {left}")
    return "no infer@ unit or front door active, no server process left, rendered units removed"


# -- issue 30, item 6: the front door's port is never another user's ------------------------------

@scenario("p1-port-before-start")
def p1_port_before_start() -> str:
    """numa-infer-port.socket holds the front door's addresses before the daemon ever ran
    (enabled with it: Also=), the daemon starts on its sockets, and after a stop (the
    instances still loading) systemd alone holds them, listening."""
    sh("systemctl", "enable", "numa-infer")
    enabled = sh("systemctl", "is-enabled", PORT_SOCKET, check=False).strip()
    sh("systemctl", "disable", "numa-infer")  # this group starts it by hand
    if enabled != "enabled":
        raise Fail(f"systemctl enable numa-infer left {PORT_SOCKET} {enabled}")
    sh("systemctl", "start", PORT_SOCKET)
    before = port_held_by_systemd_alone("before the daemon started")
    write_config()
    since = now_str()
    sh("systemctl", "start", "numa-infer", timeout=300)
    daemon = main_pid("numa-infer")
    lines = holders(FRONT_PORT)
    # One socket per address, systemd's and the daemon's: not a second one the daemon bound.
    if len(lines) != 2 or any("pid=1," not in l or f"pid={daemon}," not in l for l in lines):
        raise Fail(f"the daemon does not listen on {PORT_SOCKET}'s sockets: {lines}")
    wait(lambda: f"from {PORT_SOCKET}" in journal_since(since), 30, f"the daemon saying it took {PORT_SOCKET}'s socket")
    sh("systemctl", "stop", "numa-infer", timeout=300)
    after = port_held_by_systemd_alone("after systemctl stop numa-infer")
    return f"before the start: {before}; the daemon started on them; after its stop: {after}"


@scenario("p2-port-listen-change")
def p2_port_listen_change() -> str:
    """frontend.listen moves to another port and back, by reloads: while it moves, another
    user never gets an old address while the new one is still free; once moved, the new one
    is held, served, and numa-infer-port.socket's drop-in names it (gone again once back)."""
    moved = FRONT_PORT + 1
    new = (f"127.0.0.1:{moved}", f"[::1]:{moved}")
    notes = []
    for addresses, previous, listen in ((new, FRONT_ADDRESSES, f"127.0.0.1:{moved}"), (FRONT_ADDRESSES, new, "")):
        port = int(addresses[0].rsplit(":", 1)[1])
        # The old addresses are anyone's once the front door has moved: only a GAP fails.
        with Squatter(*previous, probes=addresses) as squat:
            write_config(frontend=f'listen = "{listen}"' if listen else "")
            sh("systemctl", "reload", "numa-infer", timeout=300)
            wait(lambda: isinstance(complete(port), str), 120, f"a completion on :{port}")
        notes.append(squat.verdict(f"the move to :{port}", allowed=previous))
        if squat_once(*addresses):
            raise Fail(f"after the move to :{port}, another user binds {squat_once(*addresses)}")
        named = PORT_DROPIN.exists() and f"ListenStream=127.0.0.1:{port}" in PORT_DROPIN.read_text()
        if named != (port != FRONT_PORT):
            raise Fail(f"{PORT_DROPIN} after the move to :{port}: {PORT_DROPIN.read_text() if PORT_DROPIN.exists() else 'none'}")
    return "; ".join(notes) + "; the drop-in followed"


@scenario("p3-port-after-stop")
def p3_port_after_stop() -> str:
    """After the last stop: the daemon had bound :8000 itself (p2 moved it away and back),
    and numa-infer-port.socket took it over before the daemon let go."""
    held = port_held_by_systemd_alone("after the last systemctl stop numa-infer")
    if f"{PORT_SOCKET} holds" not in sh("journalctl", "-u", "numa-infer", "--no-pager", "-o", "cat", "-n", "200",
                                         check=False):
        raise Fail(f"the daemon does not say {PORT_SOCKET} took over its socket")
    return held


# -- 2 sockets x 1 core x 2 threads ------------------------------------------------------------

@scenario("10-smt")
def s10_smt() -> str:
    siblings = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read_text().strip()
    if cpulist(siblings) != {0, 1}:
        raise Fail(f"guest shows no SMT siblings for cpu0: {siblings}")
    write_config("smt = true")
    sh("systemctl", "start", "numa-infer", timeout=300)
    state = all_healthy(2)
    for i in state["instances"]:
        env = Path(f"/proc/{i['pid']}/environ").read_bytes().split(b"\0")
        if i["threads"] != 2 or len(i["cpus"]) != 2 or b"OMP_NUM_THREADS=2" not in env:
            raise Fail(f"smt=true: {i['name']} threads {i['threads']} cpus {i['cpus']}")
    write_config("smt = false")
    sh("systemctl", "reload", "numa-infer", timeout=300)
    state = all_healthy(2)
    for i in state["instances"]:
        pid = i["pid"]
        if i["threads"] != 1 or i["cpus"] != [min(node_cpus(i["node"]))]:
            raise Fail(f"smt=false: {i['name']} threads {i['threads']} cpus {i['cpus']}")
        masks = thread_masks(pid)
        if any(m != set(i["cpus"]) for m in masks.values()):
            raise Fail(f"smt=false: {i['name']} thread masks {masks}")
    sh("systemctl", "stop", "numa-infer", timeout=300)
    return "smt=true: 2 threads on both siblings; smt=false: 1 thread on the first sibling"


# -- 4 nodes x 1 CPU -----------------------------------------------------------------------------------

@scenario("11-reserve-cpu0")
def s11_reserve() -> str:
    write_config('reserve_cpus = "0"')
    sh("systemctl", "start", "numa-infer", timeout=300)
    state = all_healthy(3, timeout=400)
    names = sorted(i["name"] for i in state["instances"])
    if names != ["infer@1", "infer@2", "infer@3"]:
        raise Fail(f"instances {names}")
    for i in state["instances"]:
        if 0 in i["cpus"] or any(0 in m for m in thread_masks(i["pid"]).values()):
            raise Fail(f"{i['name']} may run on CPU 0")
    sh("systemctl", "stop", "numa-infer", timeout=300)
    return "infer@1..3 healthy, none allowed on CPU 0"


# -- the Debian package (2 nodes x 2 CPUs) --------------------------------------------------------------

SHARE = Path("/mnt/share")


def apt(*args: str) -> str:
    # The guest has no network: everything comes from its apt cache, prepared at image build.
    return sh("apt-get", "-y", "-q", "-o", "Acquire::Retries=0", "-o", "Dpkg::Use-Pty=0", *args, timeout=600)


# -- issue 19, items 7 and 9: the package's users, and HAProxy as its own ---------------------------

PACKAGED_USERS = ("numa-infer", "numa-infer-frontdoor")  # debian/numa-infer.sysusers


def packaged_users() -> str:
    """Both users exist, unprivileged, with no login shell."""
    import pwd
    found = []
    for name in PACKAGED_USERS:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise Fail(f"user {name} does not exist (sysusers.d/numa-infer.conf not applied)") from None
        if not 0 < entry.pw_uid < 1000 or not entry.pw_shell.endswith("nologin"):
            raise Fail(f"user {name}: uid {entry.pw_uid}, shell {entry.pw_shell}")
        found.append(f"{name} ({entry.pw_uid})")
    return ", ".join(found)


def frontdoor_runs_as_its_user() -> str:
    """HAProxy, master and workers, runs as numa-infer-frontdoor with no capability; its
    admin socket's directory is its own and its group's (mode 0750), and the daemon, root
    without a DAC override, reaches the socket through that group."""
    import grp
    import pwd
    user = pwd.getpwnam("numa-infer-frontdoor")
    master = main_pid("numa-infer-frontdoor")
    pids = [master, *(int(p) for p in sh("pgrep", "-P", str(master), check=False).split())]
    for pid in pids:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        uids = fields["Uid"].split()
        caps = {k: int(v, 16) for k, v in fields.items() if k in ("CapEff", "CapPrm", "CapBnd")}
        if uids != [str(user.pw_uid)] * 4 or any(caps.values()):
            raise Fail(f"haproxy pid {pid}: uids {uids}, capabilities {caps}")
    directory = os.stat("/run/numa-infer-frontdoor")
    if (directory.st_uid, directory.st_gid, directory.st_mode & 0o777) != (user.pw_uid, user.pw_gid, 0o750):
        raise Fail(f"/run/numa-infer-frontdoor: uid {directory.st_uid} gid {directory.st_gid} "
                   f"mode {directory.st_mode & 0o777:o}")
    daemon = dict(line.split(":", 1) for line in Path(f"/proc/{main_pid('numa-infer')}/status").read_text().splitlines())
    if str(grp.getgrnam("numa-infer-frontdoor").gr_gid) not in daemon["Groups"].split():
        raise Fail(f"the daemon is not in the group numa-infer-frontdoor: groups {daemon['Groups'].strip()}")
    if int(daemon["CapBnd"], 16) != (1 << 23) | (1 << 10):  # CAP_SYS_NICE, CAP_NET_BIND_SERVICE
        raise Fail(f"the daemon's bounding set is not CAP_SYS_NICE and CAP_NET_BIND_SERVICE: {daemon['CapBnd'].strip()}")
    # One listening socket per front door address (127.0.0.1 and its loopback twin, ::1),
    # the daemon's: HAProxy accepts on it (listener.py), so a HAProxy restart refuses no client.
    lines = holders(FRONT_PORT)
    daemon = main_pid("numa-infer")
    if (not any(f"127.0.0.1:{FRONT_PORT} " in l for l in lines) or len(lines) > 2
            or any(f"pid={daemon}," not in l or f"pid={master}," not in l for l in lines)):
        raise Fail(f"the front door's port is not one socket per address held by the daemon and HAProxy: {lines}")
    return f"numa-infer-frontdoor (uid {user.pw_uid}, {len(pids)} processes, no capability; on the daemon's socket)"


@scenario("d1-install")
def d1_install() -> str:
    global NI
    deb = sorted(SHARE.glob("debs/numa-infer_0.1.0_all.deb"))[0]
    if "haproxy" not in sh("dpkg-deb", "-f", str(deb), "Depends"):
        raise Fail("the package does not depend on haproxy")
    apt("install", "--no-install-recommends", str(deb))
    NI = "/usr/bin/numa-infer"
    version = sh(NI, "--version").strip()
    enabled = sh("systemctl", "is-enabled", "numa-infer", PORT_SOCKET, check=False).split()
    active = sh("systemctl", "is-active", "numa-infer", PORT_SOCKET, check=False).split()
    failed = sh("systemctl", "list-units", "--failed", "--plain", "--no-legend", check=False).strip()
    if enabled != ["disabled"] * 2 or active != ["inactive"] * 2 or failed:
        raise Fail(f"after install: enabled={enabled} active={active} (numa-infer, {PORT_SOCKET}) "
                   f"failed units={failed!r}")
    for path in ("/usr/lib/systemd/system/numa-infer.service", f"/usr/lib/systemd/system/{PORT_SOCKET}",
                 "/usr/share/man/man8/numa-infer.8.gz",
                 "/usr/share/man/man5/numa-infer.toml.5.gz", "/usr/share/bash-completion/completions/numa-infer"):
        if not Path(path).exists():
            raise Fail(f"{path} not installed")
    if "/etc/numa-infer.toml" not in sh("dpkg-query", "-W", "-f=${Conffiles}", "numa-infer"):
        raise Fail("/etc/numa-infer.toml is not a conffile")
    users = packaged_users()
    return f"{version}; installed disabled and inactive, no failed unit; users {users}"


@scenario("d2-configure-start")
def d2_start() -> str:
    sh("systemctl", "enable", "numa-infer")
    # The port from boot comes with the daemon (Also=).
    if sh("systemctl", "is-enabled", PORT_SOCKET, check=False).strip() != "enabled":
        raise Fail(f"systemctl enable numa-infer did not enable {PORT_SOCKET}")
    return s1_start.__wrapped__()


@scenario("d3-upgrade")
def d3_upgrade() -> str:
    deb = sorted(SHARE.glob("debs/numa-infer_0.1.0+*_all.deb"))[0]
    (pids, took), load = under_load(
        lambda: instances_survive(lambda: apt("install", "--no-install-recommends", str(deb)), "the upgrade"),
        "the package upgrade")
    version = sh("dpkg-query", "-W", "-f=${Version}", "numa-infer")
    return f"upgraded to {version}, daemon restarted, healthy after {took:.1f}s; instances kept {pids}; {load}"


@scenario("d4-purge")
def d4_purge() -> str:
    model = Path(MODEL)
    apt("purge", "numa-infer")
    active = sh("systemctl", "list-units", "--plain", "--no-legend", "--state=active", "infer@*", "numa-infer*", check=False).strip()
    servers = sh("pgrep", "-af", "llama_cpp.server", check=False).strip()
    left = [p for p in ("/etc/numa-infer.toml", "/usr/bin/numa-infer", "/usr/lib/systemd/system/numa-infer.service",
                        "/run/numa-infer") if Path(p).exists()]
    left += sorted(str(p) for p in Path("/run/systemd/system").glob("infer@*"))
    left += sorted(str(p) for p in Path("/run/systemd/system").glob("numa-infer-frontdoor*"))
    if active or servers or left:
        raise Fail(f"after purge: active {active!r}, processes {servers!r}, files {left}")
    if not model.exists():
        raise Fail("purge removed the operator's model file")
    return "nothing running, package files gone, the operator's model kept"


# -- the second engine: llama.cpp's llama-server, 2 slots per instance ------------------------------

@scenario("e1-llama-server")
def e1_llama_server() -> str:
    """engine = "llama-server" under systemd: healthy, pinned, weights local, both slots used."""
    global ENGINE
    ENGINE = "llama-server"
    sh("rm", "-rf", LLAMA_SERVER_DIR)
    sh("cp", "-r", str(SHARE / "llama-server"), LLAMA_SERVER_DIR)
    sh("chmod", "-R", "a+rX", LLAMA_SERVER_DIR)
    write_config()
    sh(NI, "check", timeout=120)
    t0 = time.monotonic()
    sh("systemctl", "start", "numa-infer", timeout=300)
    state = all_healthy(2)
    took = time.monotonic() - t0
    notes = []
    for name, node in (("infer@0", 0), ("infer@1", 1)):
        pid = main_pid(name)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if cmdline[0].decode() != LLAMA_SERVER or b"--parallel" not in cmdline:
            raise Fail(f"{name} runs {cmdline[:3]}, not {LLAMA_SERVER} with --parallel")
        if Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0] == "0":
            raise Fail(f"{name} runs as root")
        cpus = node_cpus(node)
        bad = {t: m for t, m in thread_masks(pid).items() if not m <= cpus}
        if bad:
            raise Fail(f"{name} threads outside node {node} CPUs {sorted(cpus)}: {bad}")
        anon_local, _, anon = wait(lambda: (l := locality(pid, node))[2] > 0 and l, 30, "anon memory")
        # Not mmap: the weights are anonymous memory, so nearly all of the model is counted here.
        if anon_local < 0.95 or anon < Path(MODEL).stat().st_size // 2:
            raise Fail(f"{name}: {anon_local:.1%} of {anon >> 20} MiB anonymous memory on node {node} "
                       f"(model {Path(MODEL).stat().st_size >> 20} MiB)")
        complete(inst(state, name)["port"])
        notes.append(f"{name} anon {anon_local:.1%} local ({anon >> 20} MiB)")
    # Two requests at once on one instance's two slots, through the front door. llama-server
    # loads the tiny model before haproxy has started under TCG: wait for the front door to
    # listen with both instances in rotation.
    wait(lambda: (s := status()).get("frontdoor") and s["frontdoor"]["up"]
         and all(i["rotation"] == "UP" for i in s["instances"]), 180, "the front door up, both instances in rotation")
    import threading
    answers: list[str] = []
    clients = [threading.Thread(target=lambda: answers.append(complete(FRONT_PORT, timeout=240))) for _ in range(4)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    if len(answers) != 4:
        raise Fail(f"{4 - len(answers)} of 4 concurrent requests through the front door failed")
    shown = wait(lambda: (s := status()) and all(i["slots"] == 2 and i["decode_tokens_per_s"] is not None
                                                 for i in s["instances"]) and s, 30, "slots and tokens/s in status")
    text = subprocess.run([NI, "status"], capture_output=True, text=True).stdout
    if "SLOTS" not in text or "TOK/S" not in text:
        raise Fail(f"numa-infer status lacks the engine's columns:\n{text}")
    rates = [i["decode_tokens_per_s"] for i in shown["instances"]]
    # The same directory of CPU variants runs here (TCG: AVX2 at most) and on AVX-512 hosts:
    # the variant that this guest's CPU got is what status reports.
    kernels = {i["cpu_backend"] for i in shown["instances"]}
    if None in kernels:
        raise Fail(f"status names no CPU kernels for some instance: {shown['instances']}")
    return (f"all healthy {took:.1f}s after start; " + "; ".join(notes) + f"; 4 concurrent requests served; "
            f"status tokens/s {rates}; CPU kernels {sorted(kernels)}")


@scenario("e3-model-rollout")
def e3_model_rollout() -> str:
    """Under systemd: a new model file moved into place is rolled out one instance at a time
    behind the front door, `numa-infer restart` rolls one on demand, no request fails, and
    the front door's timing of each request reaches status (HAProxy's unit, in its sandbox,
    sends it to the daemon's socket)."""
    wait(lambda: (s := status()).get("frontdoor") and s["frontdoor"]["up"]
         and all(i["rotation"] == "UP" and i["state"] == "healthy" for i in s["instances"]), 300,
         "the front door up, both instances in rotation")
    names = ("infer@0", "infer@1")
    before = {name: main_pid(name) for name in names}
    since = now_str()

    def move_into_place() -> None:
        staged = MODEL + ".new"
        sh("cp", MODEL, staged)
        sh("chmod", "0644", staged)
        os.replace(staged, MODEL)  # another file at the path; no reload
        wait(lambda: all(main_pid(n) not in (0, before[n]) for n in names)
             and all(i["state"] == "healthy" and i.get("rotation") == "UP" for i in status()["instances"]),
             600, "both instances restarted on the new file", interval=2)

    _, rolled = under_load(move_into_place, "the model roll-out")
    journal = journal_since(since)
    if "the model file or the engine changed" not in journal or "model or engine changed: restarting" not in journal:
        # Both: the change noticed, and each instance's restart saying why.
        raise Fail(f"the journal does not tell the roll-out: {journal[-800:]}")
    kept = main_pid("infer@0")
    after = main_pid("infer@1")
    out, restarted = under_load(lambda: sh(NI, "restart", "1", timeout=600), "numa-infer restart 1")
    if "restarted: infer@1" not in out or main_pid("infer@1") == after or main_pid("infer@0") != kept:
        raise Fail(f"restart 1 did not restart infer@1 alone: {out[-400:]}")
    counted = {i["name"]: (i.get("time_to_first_token") or {}).get("count", 0) for i in status()["instances"]}
    if not sum(counted.values()):
        raise Fail(f"no request timing reached status from the front door: {counted}")
    return f"{rolled}; {restarted}; progress {out.strip().splitlines()}; timed requests {counted}"


@scenario("e6-client-leaves")
def e6_client_leaves() -> str:
    """Under systemd, a client that leaves a non-streaming request (issue 39, part 4): the
    daemon, in its sandbox, sees the half-closed connection in /proc/net/tcp, ends the
    request through HAProxy's runtime API, and the instance (its own unit) cancels the
    task. A context of 2048 tokens, so that the answer asked for outlasts the watch."""
    import socket
    names = ("infer@0", "infer@1")

    def context(size: int) -> None:
        before = {n: main_pid(n) for n in names}
        write_config(context_size=size)
        sh("systemctl", "reload", "numa-infer", timeout=300)
        wait(lambda: all(main_pid(n) not in (0, before[n]) for n in names)
             and (s := status()).get("frontdoor") and s["frontdoor"]["up"] and not s["frontdoor"]["reloading"]
             and all(i["rotation"] == "UP" and i["state"] == "healthy" for i in s["instances"]), 600,
             f"both instances restarted with a context of {size}, in rotation", interval=2)

    context(2048)
    since = now_str()
    body = json.dumps({"prompt": "numa", "max_tokens": 2000, "ignore_eos": True, "stream": False}).encode()
    with socket.create_connection(("127.0.0.1", FRONT_PORT), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(2)
    left = time.monotonic()
    wait(lambda: "client(s) left before their answer: stopped" in journal_since(since), 30,
         "the daemon stopping the request of a client that left")
    instances = ("--unit=infer@0.service", "--unit=infer@1.service")
    wait(lambda: "cancel task" in sh("journalctl", *instances, "--since", since, "--no-pager", "-o", "cat",
                                     check=False), 60, "the instance cancelling the task")
    took = time.monotonic() - left
    shown = sh(NI, "status", check=False)
    if "1 stopped as their client left" not in shown:
        raise Fail(f"status does not count the request stopped: {shown[:600]}")
    context(256)
    return f"the request of a client that left stopped by the daemon, the task cancelled {took:.1f}s after it left"


@scenario("e7-slots-kept")
def e7_slots_kept() -> str:
    """Under systemd, a prompt cache kept across `numa-infer restart` (issue 38, part 3): the
    server (a DynamicUser in the group numa-infer) saves its slot into its directory under
    /var/lib/numa-infer/slots, root's and the group's, mode 770; the daemon (root without
    CAP_DAC_*) reads the file to check the restore, and a probe finds the prompt cached."""
    import grp
    import stat
    port = inst(status(), "infer@0")["port"]
    prompt = " ".join(["the placement of threads and pages on a NUMA host"] * 6)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                 data=json.dumps({"prompt": prompt, "max_tokens": 2}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=240) as resp:
        json.load(resp)
    since = now_str()
    pid = main_pid("infer@0")
    out = sh(NI, "restart", "0", timeout=600)
    if "restarted: infer@0" not in out or main_pid("infer@0") == pid:
        raise Fail(f"restart 0 did not restart infer@0: {out[-400:]}")
    journal = wait(lambda: (j := journal_since(since)) and "prompt cache restored" in j and j, 120,
                   "the daemon restoring infer@0's prompt cache")
    saved = next(line for line in journal.splitlines() if "slot(s) of prompt cache" in line)
    restored = next(line for line in journal.splitlines() if "prompt cache restored" in line)
    for bad in ("not restored", "cannot make it private", "Permission denied", "no directory"):
        if bad in journal:
            raise Fail(f"the journal says {bad!r}: {journal[-1200:]}")
    where = Path("/var/lib/numa-infer/slots/infer-0")
    info = where.stat()
    if (info.st_uid, grp.getgrgid(info.st_gid).gr_name, stat.S_IMODE(info.st_mode)) != (0, "numa-infer", 0o770):
        raise Fail(f"{where}: uid {info.st_uid}, gid {info.st_gid}, mode {oct(info.st_mode)}")
    left = sorted(p.name for p in where.iterdir())
    if left:
        raise Fail(f"files left after the restore (a saved file serves one restart): {left}")
    parent = stat.S_IMODE(where.parent.stat().st_mode)
    if parent != 0o700:
        raise Fail(f"{where.parent}: mode {parent:o}, not 700")
    # The instance sees its own directory there and no other instance's.
    seen = sh("nsenter", "-t", str(main_pid("infer@0")), "-m", "ls", "-A", str(where.parent)).split()
    if seen != ["infer-0"] or not Path("/var/lib/numa-infer/slots/infer-1").is_dir():
        raise Fail(f"infer@0 sees {seen} in {where.parent}")
    return (f"{saved.split(': ', 1)[-1]}; {restored.split(': ', 1)[-1]}; {where} root:numa-infer 770, emptied; "
            f"{where.parent} 700; infer@0 sees only {seen}")


@scenario("e5-one-instance-rollout")
def e5_one_instance_rollout() -> str:
    """Under systemd, one instance on the host (issue 40): a new model file rolled out under
    load fails no request. The node has room for a second copy, so the restart surges
    (supervision/surge.py): a unit `infer@0-surge` of the same template, pinned as infer@0
    on another port, serves while infer@0 restarts, then stops and its drop-in goes. Then,
    with `frontend.surge = false`, `numa-infer restart` holds the requests instead
    (frontdoor/hold.py). The queue timeout is raised past TCG's model load (over a minute)."""
    write_config("nodes = [0]", frontend="queue_timeout_s = 280\n")
    sh("systemctl", "reload", "numa-infer", timeout=300)
    wait(lambda: sh("systemctl", "is-active", "infer@1", check=False).strip() != "active", 200,
         "infer@1 stopped after its drain")
    wait(lambda: (s := status()).get("frontdoor") and s["frontdoor"]["up"] and len(s["instances"]) == 1
         and s["instances"][0]["rotation"] == "UP" and s["instances"][0]["state"] == "healthy", 300,
         "one instance in rotation")
    before = main_pid("infer@0")
    since = now_str()
    copy_seen: list[str] = []

    def copy_placed() -> None:
        shown = sh("systemctl", "show", "-p", "ActiveState,CPUAffinity,NUMAMask", "infer@0-surge", check=False)
        if "ActiveState=active" in shown and not copy_seen:
            copy_seen.append(" ".join(shown.split()))

    def back() -> bool:
        copy_placed()
        cover = status()["instances"][0].get("restart_cover") or ""
        return (main_pid("infer@0") not in (0, before) and "its copy stopped" in cover
                and all(i["state"] == "healthy" and i.get("rotation") == "UP" for i in status()["instances"]))

    def move_into_place() -> None:
        staged = MODEL + ".new"
        sh("cp", MODEL, staged)
        sh("chmod", "0644", staged)
        os.replace(staged, MODEL)
        wait(back, 600, "infer@0 restarted on the new file and its copy stopped", interval=2)

    _, rolled = under_load(move_into_place, "the roll-out of the only instance")
    journal = journal_since(since)
    if "surge: infer@0-surge started on port" not in journal or "surge over: infer@0-surge stopped" not in journal:
        raise Fail(f"the journal does not say the surge: {journal[-1500:]}")
    mine = sh("systemctl", "show", "-p", "CPUAffinity,NUMAMask", "infer@0")
    if not copy_seen or any(line not in copy_seen[0] for line in mine.split()):
        raise Fail(f"the copy was not seen running pinned as infer@0 ({mine.split()}): {copy_seen}")
    if os.path.exists("/run/systemd/system/infer@0-surge.service.d"):
        raise Fail("the copy's drop-in was left behind")
    surged = status()["instances"][0]["restart_cover"]

    write_config("nodes = [0]", frontend="queue_timeout_s = 280\nsurge = false\n")
    sh("systemctl", "reload", "numa-infer", timeout=300)
    before, since = main_pid("infer@0"), now_str()

    def restart() -> None:
        sh(NI, "restart", "--timeout", "500", timeout=560)
        wait(lambda: main_pid("infer@0") not in (0, before)
             and all(i["state"] == "healthy" and i.get("rotation") == "UP" for i in status()["instances"]),
             300, "infer@0 restarted", interval=2)

    _, held = under_load(restart, "numa-infer restart of the only instance, surge = false")
    journal = journal_since(since)
    cover = status()["instances"][0].get("restart_cover") or ""
    if "wait for it (up to frontend.queue_timeout_s = 280s)" not in journal or not cover.startswith(
            "hold: frontend.surge = false"):
        raise Fail(f"the restart did not hold: {cover!r}; {journal[-800:]}")
    return f"{rolled}: {surged}; copy {copy_seen[0]}; {held}: {cover}"


@scenario("e2-instances-elsewhere")
def e2_instances_elsewhere() -> str:
    """server.host on another address of this machine, the front door on loopback: before,
    its unit allowed localhost only, every server went DOWN and every request got a 503."""
    address = "10.1.2.3"
    sh("systemctl", "stop", "numa-infer", timeout=300)
    if address not in sh("ip", "-4", "addr", "show", "dev", "lo"):
        sh("ip", "addr", "add", f"{address}/32", "dev", "lo")  # not loopback to systemd's "localhost"
    write_config(server_extra=f'host = "{address}"\n')
    sh(NI, "check", timeout=120)
    sh("systemctl", "start", "numa-infer", timeout=300)
    all_healthy(2)
    allowed = sh("systemctl", "show", "-p", "IPAddressAllow", "--value", "numa-infer-frontdoor").split()
    if not any(a.startswith(address) for a in allowed):
        raise Fail(f"numa-infer-frontdoor allows {allowed}, not {address}")
    for name in ("infer@0", "infer@1"):
        listening = sh("ss", "-Htlnp", check=False)
        port = inst(status(), name)["port"]
        if f"{address}:{port}" not in listening:
            raise Fail(f"{name} does not listen on {address}:{port}:\n{listening}")
    wait(lambda: (s := status()).get("frontdoor") and s["frontdoor"]["up"]
         and all(i["rotation"] == "UP" for i in s["instances"]), 180, "both instances in rotation")
    answers = [complete(FRONT_PORT, timeout=240) for _ in range(4)]
    return f"instances on {address}, front door allows {' '.join(allowed)}; {len(answers)} requests through :{FRONT_PORT}"


# -- several models on one host (issue 31): placed per node, routed by `model` -----------------------

SECOND_MODEL = "/var/lib/numa-infer/models/small.gguf"


def write_models_config(*tables: str) -> None:
    """[[models]] tables (name, path, placement), the engine group's server, TCG's monitor."""
    CONFIG.write_text(
        "".join(f"[[models]]\n{t}context_size = 256\n" for t in tables)
        + f'[server]\n{ENGINE_KEYS[ENGINE]}\n'
        "[monitor]\ninterval_s = 2.0\nstartup_grace_s = 240\nmax_restarts = 10\n"
        "[tuning]\nprobe_timeout_s = 5.0\nunhealthy_after = 2\nrestart_backoff_s = 1.0\n[frontend]\n"
    )


def ask(model, timeout: float = 240) -> tuple[int, dict]:
    """(status, JSON body) of one completion through the front door naming `model`."""
    req = urllib.request.Request(f"http://127.0.0.1:{FRONT_PORT}/v1/completions", method="POST",
                                 data=json.dumps({"model": model, "prompt": "numa", "max_tokens": 4}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def models_in_rotation(names: list[str], timeout: float = 400) -> dict:
    return wait(lambda: (s := status()).get("frontdoor") and s["frontdoor"]["up"]
                and sorted(i["name"] for i in s["instances"]) == sorted(names)
                and all(i["state"] == "healthy" and i.get("rotation") == "UP" for i in s["instances"]) and s,
                timeout, f"{names} healthy and in rotation", interval=2)


class ModelLoad(Load):
    """Clients asking one model by name; every answer must come from that model."""

    def __init__(self, model: str, clients: int = 1) -> None:
        super().__init__(clients)
        self.model = model

    def _client(self, limit: int, prompt: str) -> None:
        for _ in range(limit):
            if self._stop.is_set():
                return
            try:
                code, body = ask(self.model, timeout=300)
                if code != 200 or body.get("model") != self.model:
                    raise Fail(f"{code} from model {body.get('model')!r}: {str(body)[:200]}")
                with self._lock:
                    self.ok += 1
            except Exception as exc:  # every kind of failure counts
                with self._lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")


@scenario("e4-two-models")
def e4_two_models() -> str:
    """Two models on the 2-node guest under systemd: both answer through the front door by
    name and alias, an unknown one gets a JSON 404; a reload that adds a third model starts
    only its instance; kill -9 of one model's instance fails none of the other's requests."""
    sh("systemctl", "stop", "numa-infer", timeout=300)
    sh("cp", MODEL, SECOND_MODEL)
    sh("chmod", "0644", SECOND_MODEL)
    chat = f'name = "chat"\naliases = ["gpt-x"]\npath = "{MODEL}"\ncores_per_instance = 1\n'
    small = f'name = "small"\npath = "{SECOND_MODEL}"\nnodes = [0]\n'
    write_models_config(chat, small)
    sh(NI, "check", timeout=120)
    t0 = time.monotonic()
    sh("systemctl", "start", "numa-infer", timeout=300)
    first = ["infer@chat-0", "infer@chat-1", "infer@small-0"]
    models_in_rotation(first)
    took = time.monotonic() - t0
    for name in first:  # each on its own core of its node
        cpus = cpulist(sh("systemctl", "show", "-p", "CPUAffinity", "--value", name).replace(" ", ","))
        if len(cpus) != 1:
            raise Fail(f"{name} has CPUs {sorted(cpus)}, not one core")
    routed = {m: ask(m) for m in ("chat", "gpt-x", "small")}
    wrong = {m: r for m, r in routed.items() if r[0] != 200 or r[1].get("model") != {"gpt-x": "chat"}.get(m, m)}
    if wrong:
        raise Fail(f"not answered by the named model: {wrong}")
    code, body = ask("nope")
    if code != 404 or body.get("error", {}).get("code") != "model_not_found" or "small" not in str(body):
        raise Fail(f"an unknown model got {code}: {body}")
    with urllib.request.urlopen(f"http://127.0.0.1:{FRONT_PORT}/v1/models", timeout=30) as resp:
        listed = sorted(m["id"] for m in json.load(resp)["data"])
    if not {"chat", "small"} <= set(listed):
        raise Fail(f"/v1/models at the front door lists {listed}")
    # A third model on node 1's free core: a reload starts it alone.
    pids = {n: main_pid(n) for n in first}
    third = f'name = "third"\npath = "{SECOND_MODEL}"\nnodes = [1]\n'
    write_models_config(chat, small, third)
    sh(NI, "reload", timeout=300)
    models_in_rotation([*first, "infer@third-1"])
    moved = {n: (pids[n], main_pid(n)) for n in first if main_pid(n) != pids[n]}
    if moved:
        raise Fail(f"adding a model restarted other instances: {moved}")
    if ask("third")[1].get("model") != "third":
        raise Fail("the third model does not answer by name")
    # kill -9 of small's instance while chat is asked: no chat request fails.
    victim = main_pid("infer@small-0")

    def kill_small() -> None:
        os.kill(victim, signal.SIGKILL)
        wait(lambda: (i := inst(status(), "infer@small-0"))["state"] == "healthy" and i["pid"] not in (None, victim),
             300, "infer@small-0 back", interval=2)

    with ModelLoad("chat") as load:
        time.sleep(3)
        kill_small()
        time.sleep(3)
    verdict = load.verdict("kill -9 of infer@small-0, asking chat")
    return (f"3 instances healthy {took:.0f}s after start; chat, gpt-x, small routed right, unknown -> 404; "
            f"/v1/models {listed}; reload added infer@third-1 alone; {verdict}")


# -- chaos: random faults under a steady load, under systemd (bench/chaos.py on the host) ------------

def chaos_request(stream: bool) -> str:
    """One completion through the front door: "ok", or where it failed ("before: ..." when no
    byte came back, "in flight: ...", "cut": a stream that ended without a finish_reason)."""
    body = json.dumps({"prompt": "numa", "max_tokens": 8, "stream": stream}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{FRONT_PORT}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    got = False
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            if not stream:
                got = True
                json.load(resp)
                return "ok"
            finished = False
            for raw in resp:
                got = True
                line = raw.decode().replace('":"', '": "')
                finished = finished or ('"finish_reason": "' in line)
            return "ok" if finished else "cut"
    except Exception as exc:  # every kind of failure counts
        # A URLError wraps what happened to the connection (ConnectionRefusedError...): name that.
        reason = getattr(exc, "reason", None)
        what = getattr(exc, "code", "") or type(reason if isinstance(reason, OSError) else exc).__name__
        return f"{'in flight' if got else 'before'}: {what}"


def chaos_by_design(outcome: str) -> bool:
    """A failure before the first byte that no front door can prevent: the JSON 502 of the
    request an instance died answering (never replayed, on purpose), or a connection that a
    SIGKILLed HAProxy had already accepted (it dies with it). bench/chaos.py says the same."""
    return ((outcome.startswith("before: 502") and outcome.endswith("(after kill-instance)"))
            or (outcome.startswith(("before: RemoteDisconnected", "before: ConnectionResetError",
                                    "before: BrokenPipeError")) and outcome.endswith("(after kill-haproxy)")))


def chaos_fault(fault: str, state: dict) -> str:
    pick = random.choice([i for i in state["instances"] if i["pid"]] or [None])
    if fault in ("kill-instance", "stop-instance", "affinity-drift", "memory-drift") and pick is None:
        return "no instance running"
    if fault == "kill-instance":
        os.kill(pick["pid"], signal.SIGKILL)
    elif fault == "stop-instance":
        os.kill(pick["pid"], signal.SIGSTOP)
        threading.Timer(20, lambda: subprocess.run(["kill", "-CONT", str(pick["pid"])])).start()
    elif fault == "affinity-drift":
        sh("taskset", "-a", "-p", "-c", "0-3", str(pick["pid"]), check=False)
    elif fault == "memory-drift":
        sh("migratepages", str(pick["pid"]), str(pick["mems"][0]), str(1 - pick["mems"][0]), check=False)
    elif fault == "reload-one":
        # Reserving CPU 1 changes infer@0 alone (CPUs 0-1 -> 0): a drained rolling restart
        # of one instance while the other serves.
        global CHAOS_RESERVED
        CHAOS_RESERVED = not CHAOS_RESERVED
        write_config('reserve_cpus = "1"' if CHAOS_RESERVED else "")
        sh("systemctl", "reload", "numa-infer", timeout=300, check=False)
        return "infer@0 on CPU 0 only" if CHAOS_RESERVED else "infer@0 on CPUs 0-1 again"
    elif fault == "reload-invalid":
        good = CONFIG.read_text()
        CONFIG.write_text(good + "\n[placement\n")
        sh("systemctl", "reload", "numa-infer", timeout=300, check=False)
        CONFIG.write_text(good)
    elif fault == "kill-haproxy":
        sh("systemctl", "kill", "-s", "KILL", "numa-infer-frontdoor")
    elif fault == "kill-daemon":
        sh("systemctl", "kill", "-s", "KILL", "--kill-whom=main", "numa-infer")  # Restart=on-failure brings it back
    return pick["name"] if pick and fault.endswith(("instance", "drift")) else fault


CHAOS_RESERVED = False
CHAOS_FAULTS = ("kill-instance", "stop-instance", "affinity-drift", "reload-one", "reload-invalid", "kill-haproxy",
                "kill-daemon", "memory-drift")


@scenario("c1-chaos")
def c1_chaos() -> str:
    """Random faults under 2 clients (one streaming) through the front door: at least 3 minutes,
    and every fault kind at least once."""
    import collections
    random.seed(int(os.environ.get("CHAOS_SEED", "1")))
    outcomes: collections.Counter = collections.Counter()
    stop = threading.Event()

    last = ["none"]  # the fault struck last: what a failure is put down to

    def client(stream: bool) -> None:
        while not stop.is_set():
            outcome = chaos_request(stream)
            outcomes[outcome if outcome == "ok" else f"{outcome} (after {last[0]})"] += 1
            if outcome != "ok":
                time.sleep(1)  # as OpenAI's clients do (Retry-After: 1 on the front door's 503)

    clients = [threading.Thread(target=client, args=(k == 1,), daemon=True) for k in range(2)]
    for c in clients:
        c.start()
    heals: list[tuple[str, float]] = []
    unhealed: list[str] = []
    # Each fault in turn (shuffled) before any repeats: a short soak still meets all eight.
    order = random.sample(CHAOS_FAULTS, len(CHAOS_FAULTS))
    started = time.monotonic()
    deadline = started + float(os.environ.get("CHAOS_SECONDS", "180"))
    # At least 3 minutes, and on until every kind has struck once (TCG heals slowly: 8
    # kinds take about 4 minutes), within 7 minutes.
    while time.monotonic() < deadline or (len(heals) + len(unhealed) < len(order)
                                          and time.monotonic() < started + 420):
        struck_so_far = len(heals) + len(unhealed)
        fault = order[struck_so_far] if struck_so_far < len(order) else random.choice(CHAOS_FAULTS)
        # The daemon's state file, not `numa-infer status`: once, just after HAProxy came
        # back, a Python start under TCG took over the 60 s limit (the same data, as JSON).
        seen = json.loads(Path("/run/numa-infer/state.json").read_text())
        last[0] = fault
        # Healing counts from the fault's start; a reload fault includes `numa-infer reload`
        # (ExecReload=), which returns once the daemon applied or refused the new file.
        struck, struck_wall = time.monotonic(), time.time()
        detail = chaos_fault(fault, seen)

        def healed() -> bool:
            # The daemon's own state file, not `numa-infer status` (a Python start takes
            # seconds under TCG, more under load): from a pass that began after the fault (one
            # that read /proc before it says nothing of it), by a live daemon.
            s = json.loads(Path("/run/numa-infer/state.json").read_text())
            return (s["daemon"]["state"] == "running" and (s["daemon"].get("pass_started_at") or 0) > struck_wall
                    and Path(f"/proc/{s['daemon']['pid']}").exists()
                    and len(s["instances"]) == 2 and bool(s["frontdoor"]) and s["frontdoor"]["up"]
                    and all(i["state"] == "healthy" and not i["drifting"] and i["rotation"] == "UP"
                            for i in s["instances"]))
        time.sleep(0.5)
        try:
            wait(healed, 300, f"healthy again after {fault}", interval=0.2)
            heals.append((fault, time.monotonic() - struck))
            said = f"healed after {heals[-1][1]:.1f}s"
        except Fail:
            unhealed.append(fault)
            said = "NOT healed within 300s"
        print(f"  chaos: {fault} ({detail}): {said}", flush=True)
        time.sleep(3)
    stop.set()
    for c in clients:
        c.join(330)
    if CHAOS_RESERVED:
        chaos_fault("reload-one", status())
        all_healthy(2)
    times = sorted(t for _, t in heals)
    p50 = times[len(times) // 2] if times else float("nan")
    p99 = times[-1] if times else float("nan")
    before = {k: v for k, v in outcomes.items() if k.startswith("before") and not chaos_by_design(k)}
    failed = {k: v for k, v in outcomes.items() if k != "ok"}
    figures = (f"{sum(outcomes.values())} requests, {outcomes['ok']} ok, failed {failed or 'none'}; "
               f"before the first byte and within the front door's reach (goal 0): {sum(before.values())}; "
               f"{len(heals)}/{len(heals) + len(unhealed)} faults healed, p50 {p50:.1f}s, max {p99:.1f}s: "
               + ", ".join(f"{f} {t:.0f}s" for f, t in heals))
    (SHARE / "chaos.txt").write_text(figures + "\n")
    if unhealed:
        raise Fail(f"not healthy again within 300s after {unhealed}; {figures}")
    # The figures are the result; failures before a first byte are what the soak exists to
    # count (goal 0), so they are reported, not hidden; only a fleet that did not heal fails.
    return figures + (f"; BEFORE FIRST BYTE: {before}" if before else "")


# -- benchmark (not part of CI): aggregate decode rate on the 2-node guest ------------------------------

def aggregate_rate(ports: list[int], rounds: int, tokens: int) -> float:
    """Concurrent clients (one per entry of `ports`), each `rounds` completions; total tokens/s."""
    import threading
    done: list[int] = []

    def client(port: int) -> None:
        for _ in range(rounds):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "numa node", "max_tokens": tokens, "temperature": 0}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=900) as resp:
                done.append(json.load(resp)["usage"]["completion_tokens"])

    clients = [threading.Thread(target=client, args=(p,)) for p in ports]
    t0 = time.monotonic()
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    return sum(done) / (time.monotonic() - t0)


@scenario("b1-aggregate-throughput")
def b1_aggregate() -> str:
    """Four clients through the front door: two per-node instances behind it vs one
    interleaved instance over all CPUs behind it (same endpoint, same clients)."""
    global MODEL
    MODEL = "/var/lib/numa-infer/models/bench.gguf"
    sh("install", "-D", "-m", "0644", str(SHARE / "bench.gguf"), MODEL)
    # Under TCG a completion takes tens of seconds: the queue may wait that long. Least
    # connections: the four clients send one prompt, which prefix routing would keep on one
    # instance as far as its load bound allows; this measures placement, not routing.
    slow = 'queue_timeout_s = 1800\nrequest_timeout_s = 1800\naffinity = "none"\n'
    write_config(frontend=slow)
    sh("systemctl", "start", "numa-infer", timeout=300)
    state = all_healthy(2)
    direct = aggregate_rate([i["port"] for i in state["instances"]], 2, 16)  # one client per instance, by hand
    per_node = aggregate_rate([FRONT_PORT] * 4, 2, 16)
    journal = sh("journalctl", "-u", "infer@0", "-u", "numa-infer", "--no-pager", "-o", "cat", "-p", "warning",
                 check=False).strip().splitlines()[-5:]
    print(f"b1: direct {direct:.2f} tokens/s, through the front door {per_node:.2f}; warnings: {journal}", flush=True)
    sh("systemctl", "stop", "numa-infer", timeout=300)
    write_config('mode = "interleave"', frontend=slow)
    sh("systemctl", "start", "numa-infer", timeout=300)
    (one,) = all_healthy(1)["instances"]
    single = aggregate_rate([FRONT_PORT] * 4, 2, 16)
    sh("systemctl", "stop", "numa-infer", timeout=300)
    return (f"two per-node instances (2 threads each), two clients on their ports: {direct:.2f} tokens/s; "
            f"four clients through the front door: two per-node instances {per_node:.2f} tokens/s; "
            f"one interleaved instance ({one['threads']} threads) {single:.2f} tokens/s; ratio {per_node / single:.2f}x (TCG)")


@scenario("b2-syscall-filter-cost")
def b2_filter_cost() -> str:
    """Not in CI: the instances' decode rate with and without their SystemCallFilter=, in one boot."""
    global MODEL
    MODEL = "/var/lib/numa-infer/models/bench.gguf"
    sh("install", "-D", "-m", "0644", str(SHARE / "bench.gguf"), MODEL)
    write_config()
    sh("systemctl", "start", "numa-infer", timeout=300)
    state = all_healthy(2)
    ports = [i["port"] for i in state["instances"]]
    filtered = aggregate_rate(ports, 1, 16)
    for name in ("infer@0", "infer@1"):
        drop = Path(f"/run/systemd/system/{name}.service.d/90-no-filter.conf")
        drop.parent.mkdir(parents=True, exist_ok=True)
        drop.write_text("[Service]\nSystemCallFilter=\n")
    sh("systemctl", "daemon-reload")
    pids = {n: main_pid(n) for n in ("infer@0", "infer@1")}
    sh("systemctl", "restart", "infer@0", "infer@1", timeout=300)
    wait(lambda: all(main_pid(n) not in (0, p) for n, p in pids.items()), 120, "restarted")
    all_healthy(2)
    unfiltered = aggregate_rate(ports, 1, 16)
    sh("systemctl", "stop", "numa-infer", timeout=300)
    return f"with SystemCallFilter {filtered:.2f} tokens/s, without {unfiltered:.2f} tokens/s"


# -- the container image under podman (2 nodes x 2 CPUs; crun, cgroup v2) ---------------------------
# What the kubelet's static CPU manager gives a Guaranteed pod is a cpuset (and, without one,
# a CPU quota): here podman sets the same cgroup v2 files on the same emulated NUMA machine.

IMAGE = "localhost/numa-infer:latest"  # k0 reads the name run_suite.py saved (image.txt)
CT_DIR = Path("/srv/numa-infer")  # the config and the model, mounted into the containers
CT_STATE = "/var/lib/numa-infer/state.json"
CT_PORT = 18000  # the front door's 8000, published on the guest
CT_GRACE_S = 90  # podman stop's grace: more than the config's drain_timeout_s + stopping


def ct_config() -> None:
    """deploy/kubernetes/numa-infer.toml as the pod gets it, sized for TCG and a tiny model."""
    text = (SHARE / "container.toml").read_text()
    # drain_timeout_s: k4's 120-token stream must finish inside it; under TCG with the x64
    # kernels, beside another guest, it took over 20 s (cut after 90 of 120 chunks).
    for key, value in {"context_size": "256", "parallel": "2", "interval_s": "2.0", "drain_timeout_s": "45.0"}.items():
        text, n = re.subn(rf"(?m)^{key} = \S+", f"{key} = {value}", text)
        if n != 1:
            raise Fail(f"container.toml has no single {key} line")
    text = text.replace("[monitor]\n", "[monitor]\nstartup_grace_s = 240\n", 1)
    if "\n[tuning]\n" in text:
        raise Fail("container.toml has a [tuning] table: set probe_timeout_s in it")
    text += "\n[tuning]\nprobe_timeout_s = 5.0\n"
    (CT_DIR / "numa-infer.toml").write_text(text)


def ct_run(name: str, *options: str) -> str:
    """Start the image as the DaemonSet runs it: its own user, no capability, no privilege
    escalation, a read-only root, the config and the model mounted read-only."""
    # One pod at a time, as on a node: whatever an earlier (failed) scenario left goes first.
    sh("podman", "rm", "--all", "--force", "--time", "0", check=False)
    return sh("podman", "run", "-d", "--pull=never", "--name", name, "--read-only", "--cap-drop=all",
              "--security-opt=no-new-privileges", "--stop-timeout", str(CT_GRACE_S),
              "-v", f"{CT_DIR}/numa-infer.toml:/etc/numa-infer.toml:ro", "-v", f"{CT_DIR}/models:/models:ro",
              "-p", f"{CT_PORT}:8000", *options, IMAGE, timeout=180).strip()


def ct_status(name: str) -> dict:
    out = subprocess.run(["podman", "exec", name, "numa-infer", "--state-file", CT_STATE, "status", "--json"],
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)


def ct_healthy(name: str, count: int, timeout: float = 300) -> dict:
    def check():
        s = ct_status(name)
        return s if len(s["instances"]) == count and all(i["state"] == "healthy" for i in s["instances"]) else None
    try:
        return wait(check, timeout, f"{count} healthy instance(s) in container {name}")
    except Fail as exc:
        logs = sh("podman", "logs", "--tail", "30", name, check=False)
        raise Fail(f"{exc}\n--- podman logs --tail 30 {name}:\n{logs}")


def ct_servers(name: str) -> dict[int, int]:
    """The container's llama-server processes as this guest sees them: {port: guest PID}."""
    cid = sh("podman", "inspect", "-f", "{{.Id}}", name).strip()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            cgroup = (proc / "cgroup").read_text()
        except OSError:
            continue
        if argv and argv[0].endswith(b"llama-server") and cid in cgroup and b"--port" in argv:
            found[int(argv[argv.index(b"--port") + 1])] = int(proc.name)
    return found


def ct_check_placement(name: str, state: dict, allowed: set[int]) -> list[str]:
    """Every thread of every instance inside its planned CPUs and the container's cpuset,
    its anonymous memory on its node; what status says is what the kernel allows."""
    servers = ct_servers(name)
    notes = []
    for i in state["instances"]:
        pid = servers.get(i["port"])
        if pid is None:
            raise Fail(f"no llama-server on port {i['port']} in container {name}: {servers}")
        planned = set(i["cpus"])
        if not planned <= allowed or not planned <= node_cpus(i["node"]):
            raise Fail(f"{i['name']} planned on CPUs {sorted(planned)}: not within the cpuset {sorted(allowed)} "
                       f"and node {i['node']}")
        bad = {t: sorted(m) for t, m in thread_masks(pid).items() if not m <= planned}
        if bad:
            raise Fail(f"{i['name']} threads allowed outside CPUs {sorted(planned)}: {bad}")
        anon_local, _, anon = wait(lambda: (l := locality(pid, i["node"]))[2] > 0 and l, 30, "anon memory")
        if anon_local < 0.95:
            raise Fail(f"{i['name']}: only {anon_local:.1%} of {anon >> 20} MiB anonymous memory on node {i['node']}")
        notes.append(f"{i['name']} node {i['node']} CPUs {sorted(planned)} threads {i['threads']} "
                     f"anon {anon_local:.0%} local")
    return notes


def ct_logs(name: str) -> str:
    """The container's stdout and stderr (podman logs writes them to its own two)."""
    proc = subprocess.run(["podman", "logs", name], capture_output=True, text=True, timeout=60)
    return proc.stdout + proc.stderr


def ct_complete(timeout: float = 120) -> str:
    return complete(CT_PORT, timeout=timeout)


@scenario("k0-load-image")
def k0_load() -> str:
    global IMAGE
    IMAGE = (SHARE / "image.txt").read_text().strip()
    t0 = time.monotonic()
    sh("podman", "load", "-q", "-i", str(SHARE / "numa-infer-image.tar"), timeout=900)
    took = time.monotonic() - t0
    (CT_DIR / "models").mkdir(parents=True, exist_ok=True)
    sh("install", "-m", "0644", str(SHARE / "tiny.gguf"), str(CT_DIR / "models" / "model.gguf"))
    ct_config()
    size = int(sh("podman", "image", "inspect", "-f", "{{.Size}}", IMAGE).strip())
    user = sh("podman", "image", "inspect", "-f", "{{.Config.User}}", IMAGE).strip()
    if user.split(":")[0] in ("", "0", "root"):
        raise Fail(f"the image runs as {user!r}")
    return f"loaded in {took:.0f}s; {size / 1e6:.0f} MB; user {user}"


@scenario("k1-cpuset-one-cpu-per-node")
def k1_cpuset_per_node() -> str:
    ct_run("ni-k1", "--cpuset-cpus=0,2")
    state = ct_healthy("ni-k1", 2)
    if sorted(tuple(i["cpus"]) for i in state["instances"]) != [(0,), (2,)] or any(
            i["threads"] != 1 for i in state["instances"]):
        raise Fail(f"planned {[(i['name'], i['cpus'], i['threads']) for i in state['instances']]}, "
                   "not one thread on CPU 0 (node 0) and one on CPU 2 (node 1)")
    if "0,2" not in (state["daemon"]["allowed"] or ""):
        raise Fail(f"status does not show the allowed CPUs: {state['daemon']['allowed']!r}")
    notes = ct_check_placement("ni-k1", state, {0, 2})
    # Reported, not asserted: what podman's own seccomp profile refuses (docs/kubernetes.md).
    seccomp = [w.split(" (")[0] for w in state["daemon"]["warnings"] if " is refused here" in w]
    return "; ".join(notes) + f"; allowed: {state['daemon']['allowed']}; refused memory calls: {seccomp or 'none'}"


@scenario("k2-published-port")
def k2_published_port() -> str:
    wait(lambda: (s := ct_status("ni-k1"))["frontdoor"] and s["frontdoor"]["up"]
         and all(i["rotation"] == "UP" for i in s["instances"]), 120, "the front door up, both instances in rotation")
    texts = [ct_complete() for _ in range(4)]
    return f"4 completions through 127.0.0.1:{CT_PORT} -> the container's :8000 (e.g. {texts[0]!r})"


@scenario("k3-podman-update")
def k3_podman_update() -> str:
    """The cpuset changes under the running pod (the kubelet, an NRI plugin): a new plan;
    only the instance whose CPUs changed restarts."""
    before = ct_status("ni-k1")
    pids = {i["name"]: i["pid"] for i in before["instances"]}
    t0 = time.monotonic()
    sh("podman", "update", "--cpuset-cpus=0,2-3", "ni-k1")

    def replanned():
        s = ct_status("ni-k1")
        by = {i["name"]: i for i in s["instances"]}
        one = by.get("infer@1")
        return s if one and one["cpus"] == [2, 3] and one["state"] == "healthy" and one["threads"] == 2 else None
    state = wait(replanned, 300, "infer@1 re-planned on CPUs 2-3 and healthy")
    took = time.monotonic() - t0
    after = {i["name"]: i["pid"] for i in state["instances"]}
    if after["infer@0"] != pids["infer@0"]:
        raise Fail(f"infer@0's CPUs did not change, yet it restarted: pid {pids['infer@0']} -> {after['infer@0']}")
    if after["infer@1"] == pids["infer@1"]:
        raise Fail("infer@1 kept its pid though its CPUs changed")
    logs = ct_logs("ni-k1")
    if "a new plan (not drift)" not in logs:
        raise Fail("the daemon's log does not call the cpuset change a new plan")
    notes = ct_check_placement("ni-k1", state, {0, 2, 3})
    ct_complete()
    return (f"re-planned in {took:.0f}s: infer@0 kept pid {after['infer@0']}, infer@1 {pids['infer@1']} -> "
            f"{after['infer@1']}; " + "; ".join(notes))


@scenario("k4-podman-stop")
def k4_podman_stop() -> str:
    """SIGTERM with a stream in flight: the stream finishes, then everything stops, in time."""
    started, outcome = threading.Event(), []

    def stream() -> None:
        body = json.dumps({"prompt": "numa", "max_tokens": 120, "stream": True, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{CT_PORT}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        chunks, finished = 0, False
        try:
            with urllib.request.urlopen(req, timeout=CT_GRACE_S) as resp:
                for raw in resp:
                    chunks += raw.startswith(b"data: {")
                    started.set()
                    finished = finished or b'"finish_reason":"' in raw.replace(b'": "', b'":"')
        except Exception as exc:  # every kind of failure counts
            outcome.append(f"{type(exc).__name__} after {chunks} chunks")
            started.set()
            return
        outcome.append(f"finished after {chunks} chunks" if finished else f"cut after {chunks} chunks")

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    if not started.wait(60):
        raise Fail("the stream sent nothing within 60 s")
    t0 = time.monotonic()
    sh("podman", "stop", "ni-k1", timeout=CT_GRACE_S + 60)
    took = time.monotonic() - t0
    client.join(30)
    if not outcome or not outcome[0].startswith("finished"):
        raise Fail(f"the stream in flight at podman stop: {outcome or 'still open'}")
    code = sh("podman", "inspect", "-f", "{{.State.ExitCode}}", "ni-k1").strip()
    left = sh("pgrep", "-af", "llama-server|haproxy -", check=False).strip()
    if code != "0" or left or took >= CT_GRACE_S:
        raise Fail(f"podman stop took {took:.1f}s (grace {CT_GRACE_S}s), exit code {code}, left running: {left!r}")
    logs = ct_logs("ni-k1")
    if "infer@0: " not in logs or "frontdoor: " not in logs:
        raise Fail("the instances' and HAProxy's output is not in the container's log, named")
    sh("podman", "rm", "ni-k1")
    return (f"stopped in {took:.1f}s (grace {CT_GRACE_S}s), the stream in flight {outcome[0]}, exit code 0, "
            "no server or HAProxy left")


@scenario("k5-one-node")
def k5_one_node() -> str:
    ct_run("ni-k5", "--cpuset-cpus=2-3")
    state = ct_healthy("ni-k5", 1)
    (only,) = state["instances"]
    if only["node"] != 1 or only["cpus"] != [2, 3]:
        raise Fail(f"planned {only['name']} on node {only['node']} CPUs {only['cpus']}, not node 1's 2-3")
    notes = ct_check_placement("ni-k5", state, {2, 3})
    ct_complete()
    sh("podman", "stop", "ni-k5", timeout=CT_GRACE_S + 60)
    sh("podman", "rm", "ni-k5")
    return "; ".join(notes)


@scenario("k6-cpu-quota")
def k6_cpu_quota() -> str:
    ct_run("ni-k6", "--cpus=1")
    state = ct_healthy("ni-k6", 1)
    threads = sum(i["threads"] for i in state["instances"])
    warnings = " | ".join(state["daemon"]["warnings"])
    if threads != 1 or "CPU quota of 1" not in warnings:
        raise Fail(f"{threads} thread(s) in all under --cpus=1; warnings: {warnings!r}")
    if "CPU quota of 1" not in ct_logs("ni-k6"):
        raise Fail("the quota's warning is not in the container's log")
    ct_complete()
    sh("podman", "stop", "ni-k6", timeout=CT_GRACE_S + 60)
    sh("podman", "rm", "ni-k6")
    return f"1 thread in all; warning: {next(w for w in state['daemon']['warnings'] if 'CPU quota' in w)}"


GROUPS = {
    # 1c-api-key comes last: the key stays on for the stop, which spares a second restart
    # of both instances (a model load each, over a minute under TCG).
    # p1..p3: the front door's port from boot, through a stop, a restart, a listen change and
    # the last stop (issue 30, item 6); 8 and 8b watch it through a kill and a restart.
    "2x2": [p1_port_before_start, s1_start, s1b_frontdoor, s2_kill, s3_stop, s4_affinity, s5_memory, s6_reload,
            s7_bad_reload, s8_daemon_kill, s8b_daemon_restart, p2_port_listen_change, s1c_api_key, s1d_tenants, s9_stop,
            p3_port_after_stop],
    # A guest of its own: tune measures for minutes under TCG, and with it the 2x2 group
    # came within a few scenarios of the guest's time limit.
    "tune": [s1_start, t1_tune, s9_stop],
    "2x2smt": [s10_smt],
    "4x1": [s11_reserve],
    # e5 leaves one instance (nodes = [0]); e2 writes its own configuration and starts again.
    "engine": [e1_llama_server, s2_kill, s4_affinity, s8_daemon_kill, e3_model_rollout, e6_client_leaves,
               e7_slots_kept, e5_one_instance_rollout,
               e2_instances_elsewhere, e4_two_models, s9_stop],
    "bench": [b1_aggregate],
    "filter-cost": [b2_filter_cost],
    # Not in CI: repeats the daemon replacements that must keep instances (a flake hunt).
    "restarts": [s1_start] + [s8_daemon_kill, s8b_daemon_restart] * 8 + [s9_stop],
    # Random faults under load for 3-7 minutes, every kind once (bench/chaos.py's soak, under systemd).
    "chaos": [s1_start, c1_chaos, s9_stop],
    # What CI runs: tune, then the chaos soak, in one guest. Each on its own costs a boot, a
    # daemon start and a model load (about 3 minutes under TCG); the guest gets 1500 s.
    "tune-chaos": [s1_start, t1_tune, c1_chaos, s9_stop],
    "deb": [d1_install, d2_start, s1b_frontdoor, s2_kill, s4_affinity, d3_upgrade, d4_purge],
    # numa-infer's container image under podman: the cgroup limits a Guaranteed pod gets.
    "container": [k0_load, k1_cpuset_per_node, k2_published_port, k3_podman_update, k4_podman_stop, k5_one_node,
                  k6_cpu_quota],
}

# The emulated machine each group boots (tests/vm/image.sh run SHARE TOPO).
TOPOLOGY = {"tune": "2x2", "engine": "2x2", "filter-cost": "2x2", "2x2": "2x2", "2x2smt": "2x2smt", "4x1": "4x1", "deb": "2x2", "bench": "2x2", "restarts": "2x2", "chaos": "2x2", "tune-chaos": "2x2", "container": "2x2"}

if __name__ == "__main__":
    for run in GROUPS[sys.argv[1]]:
        run()
    sys.exit(0 if all(r.startswith("PASS") for r in RESULTS) else 1)
