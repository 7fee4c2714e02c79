"""Replace IP addresses and host names in a diagnostics report with stable, salted tags.

Users paste the node's diagnostics report into public bug reports. The addresses in it
(their LAN, their public IP, their machine's name, their peers' names) are nobody's
business, but the reader still needs to follow the story: "the peer at the same address
failed twice", "the API listened on loopback". So every address becomes a tag naming its
kind, such as `<private-ip-3f9a>`:

- the same value gets the same tag everywhere in one report, so it can still be followed;
- the tag is a salted hash and the salt is fresh per report (`Redactor()` with no salt), so
  two reports from the same user cannot be correlated, and a tag cannot be reversed by
  hashing every IPv4 address.

Kinds: `loopback-ip`, `private-ip` (RFC 1918, CGNAT, ULA, link-local), `unspecified-ip`
(0.0.0.0 and ::), `public-ip` (any other address) and `host` (DNS names).

What is searched for: IPv4 dotted quads, IPv6 addresses (bare, in `[...]` URL hosts, in
`/ip6/` multiaddrs), the name in `/dns/`, `/dns4/`, `/dns6/` and `/dnsaddr/` multiaddr
components, URL hosts (`scheme://host`), and the extra host names given to `Redactor`.
What is kept: ports, peer ids, hashes, model ids, file names, times, layer ranges and
the multiaddr/URL structure around the replaced value. A dotted word outside a URL or a
multiaddr is never taken for a host name: `model.safetensors` is a file, not a host.

Known limits, each chosen over mangling ordinary report text:
- a four-part version number with every part <= 255 (`2.13.0.1`) reads as an IPv4 address;
- a bare `::` in prose is left alone; it is tagged only as `[::]` or `/ip6/::/`;
- MAC addresses and URL credentials are not in scope and are left as they are.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from collections.abc import Iterable

LOOPBACK_IP = "loopback-ip"
PRIVATE_IP = "private-ip"
PUBLIC_IP = "public-ip"
UNSPECIFIED_IP = "unspecified-ip"
HOST = "host"

# Spelled out rather than `ipaddress.is_private`, whose meaning changed between Python
# versions and which also covers documentation and benchmark ranges; a reader of a bug
# report wants "this is on the user's own network", which is exactly these.
_PRIVATE_NETWORKS = tuple(
    ipaddress.ip_network(net)
    for net in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",  # CGNAT: the carrier's network, still not routable from outside
        "169.254.0.0/16",
        "fc00::/7",
        "fe80::/10",
    )
)

# Tag widths in hex digits. Four keeps a report readable; a later value whose four
# digits collide with an earlier one's takes eight, and so on. At 64 (the whole
# sha256) two different values would need a sha256 collision.
_TAG_WIDTHS = (4, 8, 64)

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = rf"(?:{_OCTET}\.){{3}}{_OCTET}"
# A host name as it appears in a URL or a multiaddr: labels joined by dots. A trailing
# dot is left out so that a URL ending a sentence keeps its full stop.
_DNS_NAME = r"[\w-]+(?:\.[\w-]+)*"

_ADDRESS_PATTERN = "|".join(
    (
        # Multiaddr DNS components. Matched anywhere, not only at the start of a multiaddr
        # (`/p2p-circuit/dns4/...` exists): a file path with a `/dns/` directory is rarer
        # than a leaked host name is harmful.
        rf"(?P<dns_prefix>/dns(?:4|6|addr)?/)(?P<dns_name>{_DNS_NAME})",
        # URL hosts. Userinfo, if any, is kept so that the host after it is the one tagged.
        # A bracketed IPv6 host does not match here; the IPv6 rule finds it inside `[...]`.
        rf"(?P<url_prefix>(?<![\w+.-])[A-Za-z][\w+.-]*://(?:[^\s/?#@\[\]]+@)?)"
        rf"(?P<url_host>{_DNS_NAME})",
        # IPv4: not part of a longer dotted run, so that `1.2.3.4.5` (a version, an OID)
        # is left whole, while a full stop after an address ending a sentence is allowed.
        rf"(?P<ipv4>(?<![\w.]){_IPV4}(?!\w|\.\w))",
        # IPv6 candidates: hex groups with at least two colons, an optional IPv4 tail and
        # an optional zone. Times (`12:48:34`) match this too; they fail `ip_address` and
        # are then put back unchanged. Not preceded by a word character, so `std::map` or
        # `2024-05-01T12:48:34` are never candidates.
        rf"(?P<ipv6>(?<![\w:.])(?:[0-9A-Fa-f]{{0,4}}:){{2,8}}"
        rf"(?:{_IPV4}|[0-9A-Fa-f]{{1,4}})?(?:%[\w.-]+)?(?![\w:]|\.\w))",
    )
)
_ADDRESS_RE = re.compile(_ADDRESS_PATTERN)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_ip(text: str) -> Address | None:
    """The address `text` spells, or None. IPv4-mapped IPv6 becomes its IPv4 address."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    # One peer seen over IPv4 and as ::ffff:a.b.c.d is one peer to the reader.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def ip_kind(address: Address) -> str:
    """The tag kind of an address."""
    if address.is_unspecified:
        return UNSPECIFIED_IP
    if address.is_loopback:
        return LOOPBACK_IP
    if any(address in net for net in _PRIVATE_NETWORKS if net.version == address.version):
        return PRIVATE_IP
    return PUBLIC_IP


def _hosts_pattern(hosts: Iterable[str]) -> str | None:
    """An alternative matching the given host names as whole words, or None if none."""
    # A name that is an IP is left to the IP rules, which give it its real kind (the API
    # listen host is often 127.0.0.1 or 0.0.0.0).
    names = {name.strip().lower() for name in hosts}
    names = {name for name in names if name and parse_ip(name) is None}
    if not names:
        return None
    # Longest first: alternation takes the first alternative that matches, and
    # `mybox.example.org` must win over `mybox`.
    alternatives = "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True))
    # `-` counts as part of the word because it is part of host names: `mybox-2` is
    # another machine. `.` does not, so the `mybox` in `mybox.lan` is still hidden.
    return rf"(?P<word>(?<![\w-])(?i:{alternatives})(?![\w-]))"


def _is_bare_unspecified_v6(match: re.Match[str]) -> bool:
    """True for a `::` that is not in `[::]` or `/ip6/::/`, i.e. likely punctuation."""
    if match["ipv6"] != "::":
        return False
    before = match.string[match.start() - 1 : match.start()]
    after = match.string[match.end() : match.end() + 1]
    return not (before in ("[", "/") and after in ("]", "/"))


class Redactor:
    """Tags addresses and host names in one report; make a new one for each report."""

    def __init__(self, salt: bytes | None = None, hosts: Iterable[str] = ()) -> None:
        self._salt = os.urandom(16) if salt is None else salt
        extra = _hosts_pattern(hosts)
        self._pattern = _ADDRESS_RE if extra is None else re.compile(f"{_ADDRESS_PATTERN}|{extra}")
        self._tags: dict[tuple[str, str], str] = {}
        self._taken: set[str] = set()

    def tag(self, value: str, kind: str) -> str:
        """`<kind-hex>` for `value`: the same within this Redactor, distinct per value."""
        key = (kind, value)
        known = self._tags.get(key)
        if known is not None:
            return known
        digest = hashlib.sha256(self._salt + kind.encode() + value.encode()).hexdigest()
        for width in _TAG_WIDTHS:
            tag = f"<{kind}-{digest[:width]}>"
            if tag not in self._taken:
                break
        self._tags[key] = tag
        self._taken.add(tag)
        return tag

    def redact(self, text: str) -> str:
        """`text` with every address and host name replaced by its tag."""
        return self._pattern.sub(self._replace, text)

    def _replace(self, match: re.Match[str]) -> str:
        # Each alternative ends with its own named group, so `lastgroup` names the rule.
        rule = match.lastgroup
        if rule == "dns_name":
            return match["dns_prefix"] + self._tag_name(match["dns_name"])
        if rule == "url_host":
            return match["url_prefix"] + self._tag_name(match["url_host"])
        if rule == "word":
            return self.tag(match["word"].lower(), HOST)
        if _is_bare_unspecified_v6(match):
            return match[0]
        address = parse_ip(match[0])
        if address is None:
            return match[0]  # a time, a range or other colon-separated text
        return self._tag_ip(address)

    def _tag_name(self, name: str) -> str:
        """A URL or multiaddr host: an IP if it parses as one, else a DNS name."""
        address = parse_ip(name)
        if address is not None:
            return self._tag_ip(address)
        # DNS names are case-insensitive: `Node.Example.org` is `node.example.org`.
        return self.tag(name.lower(), HOST)

    def _tag_ip(self, address: Address) -> str:
        # The canonical spelling, so that `2001:DB8::1` and `2001:db8:0:0:0:0:0:1` share a tag.
        return self.tag(str(address), ip_kind(address))
