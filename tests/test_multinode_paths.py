"""The multi-node paths of flodl_exp/jobs/job.py: which address the coordinator advertises, and Gloo's interface.

A job spanning nodes must advertise an address the other nodes reach (an IP, so no rank depends on resolving
task 0's host name as task 0 does: Debian maps a host's own name to 127.0.1.1), and Gloo must not pick
loopback. tests/test_e2e_slurm_multinode.py runs these paths on a real two-node cluster.
"""
from __future__ import annotations

import logging
import socket
from typing import Any

import pytest

from flodl_exp.config import ClusterConfig, load_cluster
from flodl_exp.jobs import job


def _cluster(**cluster: Any) -> ClusterConfig:
    return load_cluster({"executor": "slurm", "nodes": 2, "host": None, **cluster})


@pytest.fixture
def net(monkeypatch):
    """A fake network view: peers, the route to them, what names resolve to, interfaces."""
    state: dict[str, Any] = {"peers": ["n1"], "route": "10.9.0.10", "resolve": {}, "ifaces": {"10.9.0.10": "eth7"}}
    monkeypatch.setattr(job, "_peer_hosts", lambda: list(state["peers"]))
    monkeypatch.setattr(job, "_routable_address", lambda peers: state["route"] if peers else None)
    monkeypatch.setattr(job, "_own_address", lambda name: state["resolve"].get(name))
    monkeypatch.setattr(job, "_interface_of", lambda addr: state["ifaces"].get(addr))
    monkeypatch.setattr(socket, "gethostname", lambda: "n0")
    return state


def test_multi_node_coordinator_advertises_the_address_on_the_route_to_the_other_nodes(net):
    assert job.coordinator_host(_cluster()) == "10.9.0.10"
    net["resolve"]["n0"] = "10.9.0.99"  # the route wins over what the name resolves to
    assert job.coordinator_host(_cluster()) == "10.9.0.10"


def test_multi_node_falls_back_to_the_host_names_address_then_the_name(net, caplog):
    net["route"] = None
    net["resolve"]["n0"] = "10.9.0.99"
    assert job.coordinator_host(_cluster()) == "10.9.0.99"
    net["resolve"].clear()
    with caplog.at_level(logging.WARNING, logger="flodl_exp.job"):
        assert job.coordinator_host(_cluster()) == "n0"
    assert "set cluster.host" in caplog.text


def test_one_node_local_and_explicit_host_are_unchanged(net):
    assert job.coordinator_host(_cluster(nodes=1)) == "n0"
    assert job.coordinator_host(_cluster(host="192.0.2.7")) == "192.0.2.7"
    assert job.coordinator_host(load_cluster({"executor": "local", "nodes": 1, "host": None})) == "127.0.0.1"


def test_gloo_interface_is_set_only_where_gloo_would_pick_loopback(net):
    two = load_cluster({"executor": "slurm", "nodes": 2})
    env: dict = {}
    assert job.gloo_interface(two, env) == "eth7" and env == {"GLOO_SOCKET_IFNAME": "eth7"}
    env = {"GLOO_SOCKET_IFNAME": "ib0"}  # the user's choice stands
    assert job.gloo_interface(two, env) is None and env == {"GLOO_SOCKET_IFNAME": "ib0"}
    env = {}
    assert job.gloo_interface(load_cluster({"executor": "slurm", "nodes": 1}), env) is None and env == {}
    assert job.gloo_interface(load_cluster({"executor": "local", "nodes": 1}), env) is None and env == {}
    net["resolve"]["n0"] = "10.9.0.10"  # the host name has a routable address: Gloo finds it itself
    assert job.gloo_interface(two, env) is None and env == {}


def test_gloo_interface_warns_when_no_interface_is_found(net, caplog):
    net["ifaces"].clear()
    env: dict = {}
    with caplog.at_level(logging.WARNING, logger="flodl_exp.job"):
        assert job.gloo_interface(load_cluster({"executor": "slurm", "nodes": 2}), env) is None
    assert env == {} and "GLOO_SOCKET_IFNAME" in caplog.text


def test_address_helpers_on_this_machine():
    # only loopback names and addresses: nothing here may send a query or a packet off this machine
    assert job._own_address("localhost") is None  # loopback only
    assert job._routable_address(["127.0.0.1"]) is None  # a loopback route is no route to another node
    assert job._interface_of("127.0.0.1") == "lo"
    assert job._interface_of("192.0.2.250") is None
    assert job._peer_hosts() == []  # outside a job
