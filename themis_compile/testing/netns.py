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

Requires root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the kernel's bridge, veth and tbf support;
`EmulatedNodes.unavailable_reason()` says why not when it cannot be built. Everything created is
removed on exit (and names carry the process id, so concurrent users do not collide).

Legend: N nodes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess

logger = logging.getLogger(__name__)

__all__ = ["EmulatedNodes", "enter_namespace"]

_CLONE_NEWNET = 0x40000000
_IFNAME = "thx0"          # the veth end inside every node namespace (same name in each)


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


class EmulatedNodes:
    """``num_nodes`` network namespaces behind a bridge whose links carry ``inter_node_bw`` bytes/s.

    Attributes:
        num_nodes: N.
        inter_node_bw: bytes/s each node can send, and receive, across its boundary.
        store_addr: the parent's address as seen from the nodes (where the rendezvous store listens).
    """

    def __init__(self, num_nodes: int, inter_node_bw: float, *, latency_ms: float = 200.0) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        if not inter_node_bw > 0:
            raise ValueError(f"inter_node_bw must be > 0 bytes/s, got {inter_node_bw}")
        self.num_nodes = int(num_nodes)
        self.inter_node_bw = float(inter_node_bw)
        self.latency_ms = float(latency_ms)
        tag = os.getpid() % 100000
        self._bridge = f"thb{tag}"
        self._host_if = [f"th{tag}h{n}" for n in range(num_nodes)]
        self._netns = [f"themis{tag}n{n}" for n in range(num_nodes)]
        subnet = 16 + tag % 200                            # 10.213.<subnet>.0/24, one per parent process
        self._prefix = f"10.213.{subnet}"
        self.store_addr = f"{self._prefix}.254"
        self._created: list[tuple[str, ...]] = []

    # ---------------------------------------------------------------------------------- queries
    @staticmethod
    def unavailable_reason() -> str | None:
        """None when namespaces can be built here, else why not."""
        if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
            return "network namespaces need Linux"
        if os.geteuid() != 0:
            return "building network namespaces needs root"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"the `{tool}` command (iproute2) is not installed"
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
        except subprocess.CalledProcessError as exc:
            self.__exit__(None, None, None)
            raise RuntimeError(f"cannot emulate nodes: `{' '.join(exc.cmd)}` failed: {exc.stderr.strip()}") from exc
        logger.info("emulated %d nodes at %.3g B/s per node boundary", self.num_nodes, self.inter_node_bw)
        return self

    def __exit__(self, *exc: object) -> None:
        for kind, name in reversed(self._created):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self._created.clear()
