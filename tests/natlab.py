"""Homes behind NAT routers, on one machine: network namespaces, veth pairs, nftables.

    with NatLab(homes=2) as lab:
        lab.wan_ip                       # this (root) namespace on the "internet": 10.N.0.1
        lab.homes[0].ns                  # the namespace of the first home's machine
        lab.run_in(lab.homes[0], [...])  # a command there (a node: start_node's launcher)

The root namespace plays the internet: a bridge holding `wan_ip`, where the tests' own
reachable nodes listen. Each home is two namespaces: its router, on the bridge (at
`home.public_ip`), and its machine behind it (192.168.<k>.2). The router is a typical home
NAT, in nftables: it masquerades what the machine sends out (keeping the source port when
it can, as Linux does), lets in only the packets of connections the machine opened, and
drops anything new that arrives from outside (no RST: a closed home network is silent).
So a node at home can dial out, peers cannot dial it, and two homes can reach each other
only through a relay, or by a hole punch: both dialing at once from their listening
ports, each SYN leaving a mapping the other's passes through (TCP simultaneous open).

Needs root, `ip` (iproute2) and `nft` (nftables; `make test` installs it). Everything
made is removed on exit, by name (each lab's names carry its own tag).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from types import TracebackType

ROUTER_RULES = """
table ip nat {{
  chain postrouting {{
    type nat hook postrouting priority srcnat;
    oifname "wan" masquerade
  }}
}}
table ip filter {{
  chain forwarding {{
    type filter hook forward priority 0; policy drop;
    ct state established,related accept
    iifname "lan" oifname "wan" accept
  }}
  chain incoming {{
    type filter hook input priority 0; policy accept;
    iifname "wan" ct state new drop
  }}
}}
"""


@dataclass(frozen=True)
class Home:
    router_ns: str
    ns: str  # the machine behind the router
    public_ip: str  # the router's address on the internet
    ip: str  # the machine's own, behind the NAT


def missing_tools() -> list[str]:
    """What a lab needs that this machine lacks (root, ip, nft)."""
    missing = [tool for tool in ("ip", "nft") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root")
    return missing


class NatLab:
    def __init__(self, homes: int = 2) -> None:
        self.tag = f"nl{os.getpid() % 100000}"
        self.prefix = _free_prefix(16 + os.getpid() % 200)
        self.wan_ip = f"{self.prefix}.1"
        self._bridge = f"{self.tag}br"
        self.homes = [
            Home(f"{self.tag}r{i}", f"{self.tag}h{i}", f"{self.prefix}.{10 + i}", f"192.168.{i}.2")
            for i in range(homes)
        ]
        self._made: list[str] = []  # namespaces made, removed on exit

    def __enter__(self) -> NatLab:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _build(self) -> None:
        _ip("link", "add", self._bridge, "type", "bridge")
        _ip("addr", "add", f"{self.wan_ip}/24", "dev", self._bridge)
        _ip("link", "set", self._bridge, "up")
        for i, home in enumerate(self.homes):
            for ns in (home.router_ns, home.ns):
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            # the router's WAN: one end on the bridge, the other in the router as "wan"
            outside, inside = f"{self.tag}w{i}", f"{self.tag}x{i}"
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", outside, "master", self._bridge, "up")
            self._move(inside, home.router_ns, "wan", f"{home.public_ip}/24")
            # the home's LAN: router "lan" 192.168.i.1, the machine's "eth0" 192.168.i.2
            lan, eth = f"{self.tag}l{i}", f"{self.tag}e{i}"
            _ip("link", "add", lan, "type", "veth", "peer", "name", eth)
            self._move(lan, home.router_ns, "lan", f"192.168.{i}.1/24")
            self._move(eth, home.ns, "eth0", f"{home.ip}/24")
            _ip("-n", home.ns, "route", "add", "default", "via", f"192.168.{i}.1")
            _run(["ip", "netns", "exec", home.router_ns, "sysctl", "-q", "-w",
                  "net.ipv4.ip_forward=1"])  # fmt: skip
            _run(["ip", "netns", "exec", home.router_ns, "nft", "-f", "-"], ROUTER_RULES.format())

    def _move(self, link: str, ns: str, name: str, cidr: str) -> None:
        _ip("link", "set", link, "netns", ns)
        _ip("-n", ns, "link", "set", link, "name", name)
        _ip("-n", ns, "addr", "add", cidr, "dev", name)
        _ip("-n", ns, "link", "set", name, "up")

    def launcher(self, home: Home) -> list[str]:
        """`python -m swarmd` run on the home's machine (`start_node`'s launcher):
        `ip netns exec` enters the namespace and execs it, so the pid is the node's."""
        return ["ip", "netns", "exec", home.ns, sys.executable, "-m", "swarmd"]

    def run_in(self, home: Home, argv: list[str], timeout_s: float = 60.0) -> str:
        """A command on the home's machine; its stdout (it must succeed)."""
        done = subprocess.run(
            ["ip", "netns", "exec", home.ns, *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{argv[:3]} in {home.ns} failed: {done.stderr[-2000:]}")
        return done.stdout

    def http(
        self, home: Home, url: str, body: object | None = None, timeout_s: float = 300.0
    ) -> tuple[int, dict[str, object], dict[str, str]]:
        """GET `url` (or POST `body` as JSON) from the home's machine, where its node's API
        listens on its own 127.0.0.1: status, JSON body (or {"text": ...} for a plain-text
        one), headers (lower-case)."""
        payload = "" if body is None else json.dumps(body)
        out = self.run_in(home, [sys.executable, "-c", _CLIENT, url, payload], timeout_s + 10)
        answer = json.loads(out)
        return answer["status"], answer["body"], answer["headers"]

    def close(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self._made.clear()
        # The veths went with their namespaces; the bridge is this namespace's.
        subprocess.run(["ip", "link", "del", self._bridge], capture_output=True, check=False)


# The HTTP client run on a home's machine (`NatLab.http`): one request, its answer as JSON.
_CLIENT = """
import json, sys, urllib.error, urllib.request
url, payload = sys.argv[1], sys.argv[2]
data = payload.encode() if payload else None
request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=300) as response:
        status, raw, headers = response.status, response.read(), response.headers
except urllib.error.HTTPError as exc:
    status, raw, headers = exc.code, exc.read(), exc.headers
try:
    body = json.loads(raw)
except ValueError:  # a plain-text answer (the diagnostics report)
    body = {"text": raw.decode(errors="replace")}
print(json.dumps({"status": status, "body": body,
                  "headers": {k.lower(): v for k, v in headers.items()}}))
"""


def _free_prefix(start: int) -> str:
    """A 10.N.0 /24 no route of this namespace touches (from 10.`start`.0 on)."""
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    for k in range(200):
        prefix = f"10.{16 + (start - 16 + k) % 200}.0"
        if f"{prefix}." not in routes and f"{prefix.rsplit('.', 1)[0]}.0.0/" not in routes:
            return prefix
    raise RuntimeError("no free 10.N.0.0/24 for a NAT lab")


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(argv: list[str], stdin: str | None = None) -> None:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
