"""Nodes at home, behind real NAT routers on this machine (`tests/natlab.py`: network
namespaces, veth pairs, nftables masquerade that drops whatever arrives unasked).

A relay on the "internet" (this namespace), and two homes each holding half of the tiny
model: each finds out by itself that peers cannot dial it (the dial-backs die at its
router), takes a slot on the relay, and is served through it; then the two punch a hole
(DCUtR: both dial at once from their listening ports) and talk directly, so that they
keep serving each other when the relay goes away.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.conftest import NodeProcess, wait_until
from tests.e2e.test_network import ids, node_group, relay_only
from tests.e2e.test_pipeline import chat_body, complete
from tests.natlab import Home, NatLab, missing_tools


@contextlib.contextmanager
def lab_nodes(tmp_path: Path) -> Iterator[tuple[NatLab, Callable[..., NodeProcess]]]:
    """A lab of two homes, and test_network's `start` (`launcher=lab.launcher(home)`
    runs a node on a home's machine); every node is stopped, then the lab taken down."""
    assert not missing_tools(), f"the NAT lab needs {missing_tools()} (`make test` installs nft)"
    with NatLab(homes=2) as lab, node_group(tmp_path) as start:
        yield lab, start


def behind_nat_and_relayed(lab: NatLab, home: Home, node: NodeProcess) -> bool:
    _, health, _ = lab.http(home, f"{node.url}/health")
    return health.get("reachability") == "private" and relay_only(health)


def link_to(lab: NatLab, home: Home, node: NodeProcess, peer_id: str) -> str | None:
    _, peers, _ = lab.http(home, f"{node.url}/api/peers")
    for peer in peers["peers"]:  # type: ignore[union-attr]
        if peer["peer_id"] == peer_id:
            return str(peer["link"])
    return None


def test_two_homes_behind_nat_are_served_through_a_relay_then_punch_a_direct_link(
    tmp_path: Path, tiny_chat_dir: Path, tiny_reference: NodeProcess, swarm_env: None
) -> None:
    with lab_nodes(tmp_path) as (lab, start):
        relay = start("relay", "--no-model", "--relay-service", "--p2p-host", lab.wan_ip)
        boot = next(a for a in relay.p2p_addrs if f"/ip4/{lab.wan_ip}/" in a)
        home_a, home_b = lab.homes
        # Listening on every interface of its machine, as at home: what it announces
        # (its LAN address) is no use to peers on the internet.
        common = ["--bootstrap", boot, "--model", str(tiny_chat_dir), "--p2p-host", "0.0.0.0"]
        first = start("first", *common, "--layers", "0:2", launcher=lab.launcher(home_a))
        second = start("second", *common, "--layers", "2:4", launcher=lab.launcher(home_b))
        for home, node in ((home_a, first), (home_b, second)):
            assert wait_until(lambda h=home, n=node: behind_nat_and_relayed(lab, h, n), 60, 0.5)
            assert "DIAG: reachability private" in node.log_text()
        _, second_health, _ = lab.http(home_b, f"{second.url}/health")
        second_id = str(second_health["peer_id"])

        def routes_both() -> bool:
            _, models, _ = lab.http(home_a, f"{first.url}/v1/models")
            entry = models["data"][0]  # type: ignore[index]
            return len(entry["swarm"]["holders"]) == 2 and bool(entry["swarm"]["routable"])

        assert wait_until(routes_both, 60, 0.5)
        body: dict[str, Any] = chat_body("Tell me about the sea.", 12)
        body["model"] = tiny_reference.model_id
        reference, _ = complete(tiny_reference, body)
        status, reply, headers = lab.http(home_a, f"{first.url}/v1/chat/completions", body)
        assert status == 200, reply
        assert ids(reply) == ids(reference)
        assert headers["x-swarm-route"] == "relayed"

        # The hole punch: both sides say so, and the first node's link to the second is
        # direct (new streams take it).
        punched = "DIAG: hole punched"
        assert wait_until(
            lambda: punched in first.log_text() and punched in second.log_text(), 90, 0.5
        ), first.log_text()[-3000:]
        assert wait_until(lambda: link_to(lab, home_a, first, second_id) == "direct", 30, 0.5)
        _, report, _ = lab.http(home_a, f"{first.url}/api/admin/diagnostics")
        assert re.search(r"hole punching: [1-9]\d* direct connection", str(report["text"]))

        # Several sessions at once over the punched link.
        bodies = [
            {**chat_body(f"Tell me about {topic}.", 8 + 4 * i), "model": tiny_reference.model_id}
            for i, topic in enumerate(("rivers", "mountains", "the moon"))
        ]
        expected = [ids(complete(tiny_reference, b)[0]) for b in bodies]
        url = f"{first.url}/v1/chat/completions"
        with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
            at_once = list(pool.map(lambda b: lab.http(home_a, url, b), bodies))
        for (status, reply, _), want in zip(at_once, expected, strict=True):
            assert status == 200, reply
            assert ids(reply) == want

        # The relay goes away: the two homes still serve each other, directly.
        relay.stop()
        status, reply, _ = lab.http(home_a, url, body)
        assert status == 200, reply
        assert ids(reply) == ids(reference)
        assert link_to(lab, home_a, first, second_id) == "direct"
