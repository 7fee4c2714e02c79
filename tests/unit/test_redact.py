"""Addresses and host names in a diagnostics report become salted, per-report tags."""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import itertools
import re

import pytest

from swarmd.api.redact import Redactor

SALT = b"fixed-test-salt!"
PEER_A = "12D3KooWB6zuJhh7AWDUVm73e7E9Lh6jNovYpVFvsBz9ZXVX4jSt"
PEER_B = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
PEER_C = "12D3KooWHVKAWPJrQFKRiBJsqfkGtmGmNafn4zG7bDxtRyKSLXhL"
SHA_A = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
SHA_B = "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752"

SAMPLE = f"""\
swarmd 0.1.0 diagnostics
host: mybox  api: http://127.0.0.1:8800  also http://[fe80::1]:8800/v1/models
2026-05-09 12:48:34,123 INFO listening /ip4/127.0.0.1/tcp/8810/p2p/{PEER_A}
2026-05-09 12:48:34,456 INFO listening /ip4/192.168.1.20/tcp/8811/p2p/{PEER_A}
2026-05-09 12:48:34,789 INFO listening /ip6/::1/tcp/8812/p2p/{PEER_A}
peers:
  {PEER_B} /ip4/8.8.8.8/tcp/4001/p2p/{PEER_B} layers=0:10 rtt_ms=12.5
  {PEER_C} /dns4/node.example.org/tcp/8810/p2p/{PEER_C} layers=10:20 seg0_ms=3
model smollm2-135m-instruct sha256={SHA_A}
  file layers-00000-00010.safetensors sha256={SHA_B}
  file model.safetensors
last error at 12:49:01 from 192.168.1.20 (mybox), retried 8.8.8.8.
"""

INPUT_IPS = {"127.0.0.1", "fe80::1", "192.168.1.20", "::1", "8.8.8.8"}
KEPT = [
    "swarmd 0.1.0 diagnostics",
    ":8800",
    "/ip4/",
    "/ip6/",
    "/dns4/",
    "http://",
    "http://[",
    "]:8800/v1/models",
    "/tcp/8810/p2p/",
    "/tcp/8811/p2p/",
    "/tcp/8812/p2p/",
    "/tcp/4001/p2p/",
    PEER_A,
    PEER_B,
    PEER_C,
    SHA_A,
    SHA_B,
    "2026-05-09 12:48:34,123",
    "12:49:01",
    "layers=0:10",
    "layers=10:20",
    "seg0_ms=3",
    "rtt_ms=12.5",
    "smollm2-135m-instruct",
    "layers-00000-00010.safetensors",
    "file model.safetensors",
]

TAG_RE = re.compile(r"<(?P<kind>[a-z-]+)-(?P<hex>[0-9a-f]{4,})>")
# The checker is deliberately independent of the module: loose candidate runs, judged
# by `ipaddress` alone.
LOOSE_IPV4_RE = re.compile(r"\d+\.\d+\.\d+\.\d+")
LOOSE_IPV6_RE = re.compile(r"[0-9A-Fa-f:]*:[0-9A-Fa-f:]*:[0-9A-Fa-f:.]*")


def ips_in(text: str) -> set[str]:
    """Every substring of `text` that `ipaddress` accepts as an address."""
    found = set()
    for candidate in LOOSE_IPV4_RE.findall(text) + LOOSE_IPV6_RE.findall(text):
        # Try the run and the run without a trailing `:port` or full stop.
        for text_ in (candidate, candidate.rstrip("."), candidate.rsplit(":", 1)[0]):
            with contextlib.suppress(ValueError):
                found.add(str(ipaddress.ip_address(text_)))
    return found


def tags_in(text: str) -> list[str]:
    return [m[0] for m in TAG_RE.finditer(text)]


def tags_of_kind(text: str, kind: str) -> set[str]:
    return {m[0] for m in TAG_RE.finditer(text) if m["kind"] == kind}


def redacted_sample() -> str:
    return Redactor(SALT, hosts=["mybox", "127.0.0.1"]).redact(SAMPLE)


# --- the sample report ---------------------------------------------------------------------


def test_checker_finds_every_address_of_the_sample() -> None:
    assert ips_in(SAMPLE) == INPUT_IPS


def test_no_address_or_host_name_is_left() -> None:
    out = redacted_sample()
    assert ips_in(out) == set()
    for secret in [*INPUT_IPS, "node.example.org", "mybox"]:
        assert secret not in out


def test_ports_ids_hashes_times_ranges_and_file_names_are_kept() -> None:
    out = redacted_sample()
    for kept in KEPT:
        assert kept in out, kept


def test_only_the_addresses_change() -> None:
    out = redacted_sample()
    assert TAG_RE.sub("ADDR", out) == (
        SAMPLE.replace("[fe80::1]", "[ADDR]")
        .replace("/ip6/::1/", "/ip6/ADDR/")
        .replace("node.example.org", "ADDR")
        .replace("mybox", "ADDR")
        .replace("127.0.0.1", "ADDR")
        .replace("192.168.1.20", "ADDR")
        .replace("8.8.8.8", "ADDR")
    )


def test_each_kind_is_tagged_once_per_distinct_value() -> None:
    out = redacted_sample()
    assert len(tags_of_kind(out, "loopback-ip")) == 2  # 127.0.0.1 and ::1
    assert len(tags_of_kind(out, "private-ip")) == 2  # 192.168.1.20 and fe80::1
    assert len(tags_of_kind(out, "public-ip")) == 1  # 8.8.8.8
    assert len(tags_of_kind(out, "host")) == 2  # mybox and node.example.org
    assert {TAG_RE.fullmatch(t)["kind"] for t in tags_in(out)} == {
        "loopback-ip",
        "private-ip",
        "public-ip",
        "host",
    }


def test_the_same_address_gets_the_same_tag_everywhere() -> None:
    redactor = Redactor(SALT, hosts=["mybox"])
    out = redactor.redact(SAMPLE)
    loopback = redactor.tag("127.0.0.1", "loopback-ip")
    assert f"http://{loopback}:8800" in out
    assert f"/ip4/{loopback}/tcp/8810" in out
    lan = redactor.tag("192.168.1.20", "private-ip")
    assert out.count(lan) == 2
    public = redactor.tag("8.8.8.8", "public-ip")
    assert out.count(public) == 2
    assert out.count(redactor.tag("mybox", "host")) == 2


def test_different_addresses_get_different_tags() -> None:
    out = Redactor(SALT).redact("10.0.0.1 10.0.0.2 10.0.0.1")
    first, second, third = tags_in(out)
    assert first != second
    assert first == third


def test_the_tag_is_the_salted_sha256_of_kind_and_value() -> None:
    digest = hashlib.sha256(SALT + b"public-ip" + b"8.8.8.8").hexdigest()
    assert Redactor(SALT).tag("8.8.8.8", "public-ip") == f"<public-ip-{digest[:4]}>"


def test_a_fixed_salt_gives_the_same_output() -> None:
    assert redacted_sample() == redacted_sample()


def test_different_salts_give_different_tags() -> None:
    one = Redactor(b"salt-one").redact(SAMPLE)
    two = Redactor(b"salt-two").redact(SAMPLE)
    assert tags_in(one) != tags_in(two)


def test_the_default_salt_is_fresh_per_redactor() -> None:
    # Eight tags from two random salts all equal by chance: 2**-128.
    text = " ".join(f"10.0.0.{n}" for n in range(8))
    assert Redactor().redact(text) != Redactor().redact(text)


# --- text that must not change -------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "",
        "nothing to see here\n",
        "12:48:34,123",
        "2026-05-09T12:48:34.123Z",
        "took 12:48:34.5 in all",
        "layers 0:10 and 10:20, 10:20:30",
        "seg0_ms=12 tpot_ms=3.5 key=value",
        "version 0.1.0",
        "1.2.3.4.5",  # five parts: a version or an OID, not an address followed by .5
        "v1.2.3.4",
        "999.1.1.1",
        "256.1.1.1",
        "01.2.3.4",
        "model.safetensors layers-00000-00010.safetensors config.json",
        "smollm2-135m-instruct",
        PEER_A,
        SHA_A,
        "std::vector a :: b Class::add1(x)",
        "aa:bb:cc:dd:ee:ff",
        "/etc/swarmd/node.toml",
    ],
)
def test_text_without_addresses_is_unchanged(text: str) -> None:
    assert Redactor(SALT, hosts=["mybox"]).redact(text) == text


# --- kinds ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback-ip"),
        ("127.8.9.10", "loopback-ip"),
        ("::1", "loopback-ip"),
        ("10.1.2.3", "private-ip"),
        ("172.16.0.1", "private-ip"),
        ("172.31.255.254", "private-ip"),
        ("192.168.1.20", "private-ip"),
        ("100.64.0.1", "private-ip"),
        ("169.254.10.1", "private-ip"),
        ("fd12:3456::1", "private-ip"),
        ("fe80::1", "private-ip"),
        ("fe80::1%eth0", "private-ip"),
        ("8.8.8.8", "public-ip"),
        ("172.32.0.1", "public-ip"),
        ("100.128.0.1", "public-ip"),
        ("2001:4860:4860::8888", "public-ip"),
        ("0.0.0.0", "unspecified-ip"),
    ],
)
def test_an_address_is_tagged_with_its_kind(address: str, kind: str) -> None:
    out = Redactor(SALT).redact(f"at {address}, ok")
    assert re.fullmatch(rf"at <{kind}-[0-9a-f]{{4}}>, ok", out), out


@pytest.mark.parametrize("text", ["http://[::]:8800", "/ip6/::/tcp/8810"])
def test_the_unspecified_ipv6_address_is_tagged_where_it_is_an_address(text: str) -> None:
    out = Redactor(SALT).redact(text)
    assert "::" not in out
    assert tags_of_kind(out, "unspecified-ip")


def test_an_ipv4_mapped_address_is_the_ipv4_address() -> None:
    redactor = Redactor(SALT)
    out = redactor.redact("::ffff:8.8.8.8 and 8.8.8.8")
    tag = redactor.tag("8.8.8.8", "public-ip")
    assert out == f"{tag} and {tag}"


def test_ipv6_spellings_of_one_address_share_a_tag() -> None:
    out = Redactor(SALT).redact("2001:DB8::1 2001:db8:0:0:0:0:0:1")
    first, second = tags_in(out)
    assert first == second


def test_an_address_ending_a_sentence_keeps_the_full_stop() -> None:
    out = Redactor(SALT).redact("retried 8.8.8.8.")
    assert re.fullmatch(r"retried <public-ip-[0-9a-f]{4}>\.", out)


# --- host names ----------------------------------------------------------------------------


@pytest.mark.parametrize("proto", ["dns", "dns4", "dns6", "dnsaddr"])
def test_multiaddr_dns_names_are_hosts(proto: str) -> None:
    redactor = Redactor(SALT)
    out = redactor.redact(f"/{proto}/node.example.org/tcp/8810/p2p/{PEER_A}")
    tag = redactor.tag("node.example.org", "host")
    assert out == f"/{proto}/{tag}/tcp/8810/p2p/{PEER_A}"


def test_url_hosts_are_hosts_and_keep_port_and_path() -> None:
    redactor = Redactor(SALT)
    out = redactor.redact(
        "GET https://Node.Example.org:8800/v1/models?x=1 see http://node.example.org."
    )
    tag = redactor.tag("node.example.org", "host")
    assert out == f"GET https://{tag}:8800/v1/models?x=1 see http://{tag}."


def test_a_url_with_an_ip_host_is_tagged_as_that_ip() -> None:
    redactor = Redactor(SALT)
    assert (
        redactor.redact("ws://10.0.0.5:9000/")
        == f"ws://{redactor.tag('10.0.0.5', 'private-ip')}:9000/"
    )


def test_dotted_words_outside_urls_and_multiaddrs_are_not_hosts() -> None:
    text = "loaded node.example.org.safetensors from cache.dir"
    assert Redactor(SALT).redact(text) == text


def test_given_hosts_are_whole_words_any_case() -> None:
    redactor = Redactor(SALT, hosts=["MyBox", "mybox.example.org", " ", ""])
    out = redactor.redact("mybox MYBOX mybox-2 mybox2 /home/mybox/x mybox.example.org mybox.lan")
    short = redactor.tag("mybox", "host")
    full = redactor.tag("mybox.example.org", "host")
    assert out == f"{short} {short} mybox-2 mybox2 /home/{short}/x {full} {short}.lan"


def test_a_given_host_in_a_url_gets_its_word_tag() -> None:
    redactor = Redactor(SALT, hosts=["mybox"])
    out = redactor.redact("mybox http://mybox:8800")
    tag = redactor.tag("mybox", "host")
    assert out == f"{tag} http://{tag}:8800"


def test_a_given_host_that_is_an_ip_keeps_its_ip_kind() -> None:
    out = Redactor(SALT, hosts=["127.0.0.1", "0.0.0.0"]).redact("127.0.0.1 0.0.0.0")
    assert [TAG_RE.fullmatch(t)["kind"] for t in tags_in(out)] == ["loopback-ip", "unspecified-ip"]


# --- collisions ----------------------------------------------------------------------------


def colliding_pair() -> tuple[str, str]:
    """Two private IPv4 addresses whose SALT tags share their first four hex digits."""
    seen: dict[str, str] = {}
    for a, b in itertools.product(range(256), repeat=2):
        value = f"10.0.{a}.{b}"
        prefix = hashlib.sha256(SALT + b"private-ip" + value.encode()).hexdigest()[:4]
        if prefix in seen:
            return seen[prefix], value
        seen[prefix] = value
    # Deterministic for SALT; by the birthday bound one is expected within ~320 values.
    raise AssertionError("no collision among 65536 values")


def test_a_colliding_value_gets_a_longer_tag() -> None:
    first, second = colliding_pair()
    redactor = Redactor(SALT)
    out = redactor.redact(f"{first} {second} {second} {first}")
    tag_first, tag_second, again_second, again_first = tags_in(out)
    assert len(TAG_RE.fullmatch(tag_first)["hex"]) == 4
    assert len(TAG_RE.fullmatch(tag_second)["hex"]) == 8
    assert tag_second.startswith(tag_first[:-1])  # the same digest, four more digits
    assert (again_second, again_first) == (tag_second, tag_first)


def test_http_error_bodies_about_peers_carry_no_addresses() -> None:
    from swarmd.api.errors import classify
    from swarmd.errors import InvalidRequestError, PeerError, UnavailableError

    text = "stage 12D3KooWabc at /ip4/203.0.113.7/tcp/4001 and 192.168.1.20 did not answer"
    for exc in (PeerError(text), UnavailableError(text), RuntimeError(text)):
        status, body, _ = classify(exc)
        message = body["error"]["message"]  # type: ignore[index]
        assert status >= 500
        assert "203.0.113.7" not in message and "192.168.1.20" not in message
        if not isinstance(exc, RuntimeError):
            assert "12D3KooWabc" in message and "/tcp/4001" in message  # the story stays
    # A client's own request is quoted back as it was.
    _, body, _ = classify(InvalidRequestError("stop '10.0.0.1' is too long", "stop"))
    assert "10.0.0.1" in body["error"]["message"]  # type: ignore[index]


def test_503_and_500_codes_are_snake_case_names_not_class_names() -> None:
    from swarmd.api.errors import classify
    from swarmd.errors import (
        DialError,
        InternalError,
        NoRouteError,
        OverloadedError,
        QueueFullError,
        StepTimeoutError,
        StreamClosedError,
    )

    cases = [
        (NoRouteError("m", [(10, 20)]), 503, "no_route"),
        (OverloadedError("busy", 5), 503, "overloaded"),
        (StepTimeoutError("slow", 5), 503, "step_timeout"),
        (QueueFullError("full"), 503, "queue_full"),
        (DialError("cannot dial"), 503, "dial_failed"),
        (StreamClosedError("closed"), 503, "stream_closed"),
        (InternalError("bug"), 500, "internal_error"),
    ]
    for exc, status, code in cases:
        got_status, body, _ = classify(exc)
        assert (got_status, body["error"]["code"]) == (status, code), exc  # type: ignore[index]
