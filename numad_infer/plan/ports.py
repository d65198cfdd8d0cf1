"""The plan's ports: the k-th instance's port, the front door's and the metrics endpoint's
kept apart, and what listens beyond loopback said out loud.

Pure. Every refusal is a `ConfigError` naming the key an operator must change."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import replace

from numad_infer.config.schema import Config
from numad_infer.config.values import parse_listen
from numad_infer.errors import ConfigError
from numad_infer.plan.model import Instance


def assign_ports(config: Config, instances: list[Instance], source: str, kept: Mapping[str, int],
                 running: Mapping[str, int] | None = None) -> list[Instance]:
    """Step 5: the k-th instance listens on base_port + k (k counted on the whole machine,
    `kept`, where every instance has a port there). `running` (the ports of the plan running
    now), for both forms: an instance there keeps its port, so a reload that adds or removes
    a model or a node leaves every other instance as it is (a moved port is a restart); a
    new one takes the lowest free port."""
    if kept and all(i.name in kept for i in instances):
        return [replace(i, port=kept[i.name]) for i in instances]
    if running:
        return _keep_running(config, instances, source, running)
    base = config.server.base_port
    last = base + len(instances) - 1
    if last > 65535:
        raise ConfigError(
            source, "server.base_port",
            f"{len(instances)} instances need ports {base}-{last}, past 65535; use at most {65536 - len(instances)}",
            base, True,
        )
    return [replace(i, port=base + k) for k, i in enumerate(instances)]


def _keep_running(config: Config, instances: list[Instance], source: str,
                  running: Mapping[str, int]) -> list[Instance]:
    base = config.server.base_port
    ports: dict[str, int] = {}
    for i in instances:  # first come first kept: two can only share a port after a base_port change
        port = running.get(i.name)
        if port is not None and port >= base and port not in ports.values():
            ports[i.name] = port
    taken, free = set(ports.values()), base
    for i in instances:
        if i.name in ports:
            continue
        while free in taken:
            free += 1
        if free > 65535:
            raise ConfigError(source, "server.base_port", f"{len(instances)} instances need ports from {base}, past "
                              f"65535; use at most {65536 - len(instances)}", base, True)
        ports[i.name] = free
        taken.add(free)
    return [replace(i, port=ports[i.name]) for i in instances]


def exposure_warnings(config: Config) -> list[str]:
    """Anything that listens beyond loopback is said out loud (check, journal, status)."""
    found = []
    listening = [("server.host", config.server.host, "the instances (no authentication)")]
    if config.frontend.enabled:
        listening.append(("frontend.listen", config.frontend.address[0], "the front door (no authentication)"))
    if config.metrics.listen:
        listening.append(("metrics.listen", parse_listen(config.metrics.listen)[0], "the metrics endpoint"))
    for key, host, what in listening:
        if not ipaddress.ip_address(host).is_loopback:
            found.append(f"{key} = {host}: {what} can be reached from other hosts; "
                         "use 127.0.0.1 unless that is intended, and firewall it")
    return found


def check_ports(config: Config, instances: list[Instance], source: str) -> None:
    """The front door and the metrics endpoint may not take a port an instance listens on, or each other's."""
    ports = {i.port: i.name for i in instances}
    span = f"{instances[0].port}-{instances[-1].port}" if len(instances) > 1 else str(instances[0].port)
    metrics = parse_listen(config.metrics.listen)[1] if config.metrics.listen else None
    if config.frontend.enabled:
        port = config.frontend.address[1]
        if port in ports:
            raise ConfigError(source, "frontend.listen", f"port {port} is {ports[port]}'s (instances use {span}); "
                              "pick a port outside that range or move server.base_port", config.frontend.listen, True)
        if port == metrics:
            raise ConfigError(source, "frontend.listen", f"port {port} is also metrics.listen's; give each its own",
                              config.frontend.listen, True)
    if metrics in ports:
        raise ConfigError(source, "metrics.listen", f"port {metrics} is {ports[metrics]}'s (instances use {span}); "
                          "pick a port outside that range", config.metrics.listen, True)
