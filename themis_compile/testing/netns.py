"""Emulated nodes: Linux network namespaces joined by a shaped bridge, for measuring what crosses nodes.

On one machine the "nodes" of ``run_multirank(devices_per_node=...)`` are declared, not physical: every
rank talks to every other over the same loopback, so a topology-aware collective cannot show that it
sends fewer bytes over slow node boundaries. `EmulatedNodes` makes the boundary real::

    with EmulatedNodes(num_nodes=2, inter_node_bw=200e6) as net:      # 200 MB/s per node, each way
        results = run_multirank(fn, 4, devices_per_node=2, network=net)

- every node is a network namespace with its own loopback; the ranks of a node run inside it and reach
  each other over that loopback (unshaped: the intra-node links);
- every namespace has one veth link to a bridge in the parent namespace; a token bucket (``tbf``) on both
  ends caps the node's egress and its ingress at ``inter_node_bw`` bytes/s (a node's NIC, both ways);
- gloo binds to the node's veth address (``GLOO_SOCKET_IFNAME``), and the rendezvous store is reached
  at the bridge's address.

Requires CAP_NET_ADMIN and CAP_SYS_ADMIN (root on the host, not in an unprivileged container) and the
kernel's bridge, veth and tbf support; `EmulatedNodes.unavailable_reason()` says why not when it cannot
be built. Everything created is removed on exit, also when building fails half-way. Names carry the
process id and the subnet is chosen free under a host-wide lock, so concurrent users do not collide. On a
host whose firewall drops bridged traffic (an iptables FORWARD policy of DROP with
``bridge-nf-call-iptables`` on), the nodes cannot reach each other and the run fails on its timeout.

Legend: N nodes.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import re
import shutil
import subprocess

logger = logging.getLogger(__name__)

__all__ = ["EmulatedNodes", "enter_namespace"]

_CLONE_NEWNET = 0x40000000
_IFNAME = "thx0"          # the veth end inside every node namespace (same name in each)
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
_LOCK_PATH = "/run/themis-netns.lock"
_MAX_NODES = 250          # node addresses .1 .. .250 of the /24; .254 is the parent


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _tc(netns: str | None, *args: str) -> None:
    cmd = ["tc", *args] if netns is None else ["ip", "netns", "exec", netns, "tc", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def enter_namespace(netns: str) -> None:
    """Move the calling thread (and the threads it creates later) into network namespace ``netns``."""
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {netns!r} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def _host_lock():
    with open(_LOCK_PATH, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _free_prefix() -> str:
    """A 10.213.X /24 that no interface of this host uses yet."""
    used = set(re.findall(r"inet 10\.213\.(\d+)\.", _ip("-4", "-o", "addr").stdout))
    for x in range(16, 250):
        if str(x) not in used:
            return f"10.213.{x}"
    raise RuntimeError("cannot emulate nodes: no free 10.213.X.0/24 subnet left on this host")


class EmulatedNodes:
    """``num_nodes`` network namespaces behind a bridge whose links carry ``inter_node_bw`` bytes/s.

    Attributes:
        num_nodes: N.
        inter_node_bw: bytes/s each node can send, and receive, across its boundary.
        store_addr: the parent's address as seen from the nodes (where the rendezvous store listens).
    """

    def __init__(self, num_nodes: int, inter_node_bw: float, *, latency_ms: float = 200.0) -> None:
        if not 1 <= num_nodes <= _MAX_NODES:
            raise ValueError(f"num_nodes must be in [1, {_MAX_NODES}], got {num_nodes}")
        if not inter_node_bw > 0:
            raise ValueError(f"inter_node_bw must be > 0 bytes/s, got {inter_node_bw}")
        self.num_nodes = int(num_nodes)
        self.inter_node_bw = float(inter_node_bw)
        self.latency_ms = float(latency_ms)
        tag = os.getpid()                                  # <= 7 digits: names stay within 15 characters
        self._bridge = f"thb{tag}"
        self._host_if = [f"th{tag}h{n}" for n in range(num_nodes)]
        self._netns = [f"themis{tag}n{n}" for n in range(num_nodes)]
        self._prefix = ""                                  # 10.213.<free>, chosen when entered
        self.store_addr = ""
        self._created: list[tuple[str, ...]] = []

    # ---------------------------------------------------------------------------------- queries
    @staticmethod
    def unavailable_reason() -> str | None:
        """None when namespaces can be built here, else why not."""
        if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
            return "network namespaces need Linux"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"the `{tool}` command (iproute2) is not installed"
        try:
            with open("/proc/self/status") as f:
                cap_eff = int(re.search(r"^CapEff:\s*([0-9a-f]+)", f.read(), re.M).group(1), 16)
        except (OSError, AttributeError, ValueError):
            return "cannot read this process's capabilities"
        if not (cap_eff >> _CAP_NET_ADMIN & 1 and cap_eff >> _CAP_SYS_ADMIN & 1):
            return "building network namespaces needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root on the host)"
        # Capabilities inside a user namespace do not reach the host's network: try it.
        probe = f"thp{os.getpid()}"
        made = _ip("link", "add", probe, "type", "bridge", check=False)
        if made.returncode != 0:
            return f"cannot create network devices here ({made.stderr.strip() or 'ip link add failed'})"
        _ip("link", "del", probe, check=False)
        return None

    def netns_of(self, node: int) -> str:
        return self._netns[node]

    def address_of(self, node: int) -> str:
        return f"{self._prefix}.{node + 1}"

    @property
    def ifname(self) -> str:
        """The interface gloo binds to inside every node namespace."""
        return _IFNAME

    def rank_env(self, node: int) -> dict[str, str]:
        """Environment of a rank on ``node``."""
        return {"GLOO_SOCKET_IFNAME": _IFNAME, "MASTER_ADDR": self.store_addr}

    # ---------------------------------------------------------------------------------- build / tear down
    def _shape(self, netns: str | None, dev: str) -> None:
        rate = int(self.inter_node_bw)                     # bytes/s; tc reads "bps" as bytes per second
        burst = max(256 << 10, rate // 500)                # >= 2 ms of traffic and several GSO segments
        _tc(netns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate}bps", "burst", str(burst),
            "latency", f"{self.latency_ms}ms")

    def __enter__(self) -> EmulatedNodes:
        reason = self.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"cannot emulate nodes: {reason}")
        try:
            # One builder at a time on this host: the free subnet is chosen and claimed atomically.
            with _host_lock():
                self._prefix = _free_prefix()
                self.store_addr = f"{self._prefix}.254"
                _ip("link", "add", self._bridge, "type", "bridge")
                self._created.append(("link", self._bridge))
                _ip("addr", "add", f"{self.store_addr}/24", "dev", self._bridge)
            _ip("link", "set", self._bridge, "up")
            for n, (ns, host_if) in enumerate(zip(self._netns, self._host_if)):
                _ip("netns", "add", ns)
                self._created.append(("netns", ns))
                _ip("link", "add", host_if, "type", "veth", "peer", "name", _IFNAME, "netns", ns)
                self._created.append(("link", host_if))
                _ip("link", "set", host_if, "master", self._bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.address_of(n)}/24", "dev", _IFNAME)
                _ip("-n", ns, "link", "set", _IFNAME, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                self._shape(None, host_if)                 # bridge -> node: the node's ingress
                self._shape(ns, _IFNAME)                   # node -> bridge: the node's egress
        except BaseException as exc:
            self.__exit__(None, None, None)
            if isinstance(exc, subprocess.CalledProcessError):
                raise RuntimeError(f"cannot emulate nodes: `{' '.join(exc.cmd)}` failed: "
                                   f"{exc.stderr.strip()}") from exc
            raise
        logger.info("emulated %d nodes at %.3g B/s per node boundary", self.num_nodes, self.inter_node_bw)
        return self

    def __exit__(self, *exc: object) -> None:
        for kind, name in reversed(self._created):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self._created.clear()
