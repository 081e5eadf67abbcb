"""Names and interfaces for the torch.distributed rendezvous, shared by the coordinator and the ranks.

The TCPStore has no authentication of its own: task 0 binds it to the coordinator's
address only (jobs/collective_store.py), and the process groups' key
prefixes are derived from the job token here, so a process without the token cannot
predict (and so cannot pre-seed or overwrite) a group's rendezvous keys.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import socket
from collections.abc import MutableMapping
from typing import Optional

PREFIX_HEX_CHARS = 32  # 128 bits of the HMAC


def group_prefix(token: str, generation: int, session: str = "") -> str:
    """The PrefixStore name of a process group: ``g`` + a hex-truncated HMAC-SHA256 of the job
    token over the generation and the regroup session (pure; the same on every rank)."""
    msg = f"flodl-store|gen={int(generation)}|session={session}".encode()
    return "g" + hmac.new(token.encode("utf-8"), msg, hashlib.sha256).hexdigest()[:PREFIX_HEX_CHARS]


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and any loopback IP literal (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_ifname() -> Optional[str]:
    """The loopback interface's name (``lo`` on Linux), or None when it cannot be found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        if name == "lo" or name.startswith("lo0"):
            return name
    return next((n for n in names if n.startswith("lo")), None)


def pin_gloo_to_loopback(host: str, environ: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """When the coordinator is on a loopback address (a local run), make Gloo bind its pairs to the
    loopback interface (``GLOO_SOCKET_IFNAME``) instead of the host's first interface. An explicit
    setting is kept. Returns the interface now in effect (None: not pinned). Call before
    ``init_process_group``."""
    env = os.environ if environ is None else environ
    if not is_loopback_host(host):
        return env.get("GLOO_SOCKET_IFNAME")
    if "GLOO_SOCKET_IFNAME" not in env:
        name = loopback_ifname()
        if name is None:
            return None
        env["GLOO_SOCKET_IFNAME"] = name
    return env["GLOO_SOCKET_IFNAME"]
