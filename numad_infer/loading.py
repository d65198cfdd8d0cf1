"""Configuration, topology and plan, loaded and checked together, as the commands (`plan`,
`render`, `check`, offline `status`, `tune`) need them. The daemon loads its own way
(daemon._load), with the backend's view of who the instances run as."""

from __future__ import annotations

from dataclasses import dataclass

from numad_infer.config import Config, load_config
from numad_infer.identity import RunAs, instances_run_as
from numad_infer.modelfile import model_size
from numad_infer.planner import Plan, make_plan
from numad_infer.sysfs import read_topology
from numad_infer.systemctl import pid1_is_systemd
from numad_infer.topology import Topology
from numad_infer.unitdir import check_unit_names


@dataclass(frozen=True)
class Loaded:
    config: Config
    topology: Topology
    plan: Plan
    runs_as: RunAs | None  # who the instances run as (None: this user)


def load_all(config_path: str, fsroot: str) -> Loaded:
    config = load_config(config_path)
    check_unit_names(config, config_path)
    topology = read_topology(fsroot)
    # What counts is what the instances can read: under systemd a DynamicUser, otherwise
    # server.user when run as root (the backends choose the same way).
    runs_as = instances_run_as(config.server.user, config_path, systemd_units=pid1_is_systemd())
    size = model_size(config.model.path, config_path, runs_as)
    return Loaded(config, topology, make_plan(config, topology, size, source=config_path), runs_as)
