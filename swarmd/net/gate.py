"""`SwarmGate`: a private swarm keeps only the peers that prove the same swarm key.

Right after a connection opens, each side proves itself on `/swarmd/auth/1`: the
answering side sends a fresh challenge, the prover returns an HMAC bound to both peer ids
(`auth.prove`) and its own challenge, and gets the answering side's proof back. A peer
that does not prove the key in time (another key, no key, or silence) is disconnected and
banned; until it has proved it, nothing it announces is used, and no protocol serves
it: swarmd's own through `allows`, the DHT through `admit` (which waits for the verdict
on a peer that has just connected). Trio code.
"""

from __future__ import annotations

import logging
import time

import trio

from swarmd.errors import PeerError, SwarmError
from swarmd.net.auth import (
    CHALLENGE_BYTES,
    PROOF_BYTES,
    SwarmKey,
    check_proof,
    make_challenge,
    prove,
)
from swarmd.net.frames import FrameStream
from swarmd.net.host import P2PHost
from swarmd.net.loop_errors import LoopErrors, first_of
from swarmd.net.peers import PeerTable
from swarmd.net.remote_addr import remote_ip, remote_ips
from swarmd.net.safe_text import safe_text

log = logging.getLogger(__name__)

AUTH_PROTOCOL = "/swarmd/auth/1"
AUTH_TIMEOUT_S = 5.0  # the whole exchange, either side
WATCH_INTERVAL_S = 0.1  # how soon a new connection is challenged
RETRY_DELAY_S = 0.5  # before a second try at a peer that did not answer the first
# `admit` waits at most this long for a verdict: both tries of `_check` and the pause.
ADMIT_TIMEOUT_S = 2 * AUTH_TIMEOUT_S + RETRY_DELAY_S


class SwarmGate:
    def __init__(
        self,
        host: P2PHost,
        key: SwarmKey,
        peers: PeerTable,
        errors: LoopErrors | None = None,
    ) -> None:
        self._host = host
        self._key = key
        self._peers = peers
        self._errors = errors or LoopErrors()
        self._proven: set[str] = set()
        self._pending: set[str] = set()
        self._verdicts: dict[str, trio.Event] = {}  # set once a peer is proven or refused
        # Not gated: unproven peers must reach it (it checks bans itself).
        host.set_handler(AUTH_PROTOCOL, self._answer, gated=False)

    def allows(self, peer_id: str) -> bool:
        return peer_id == self._host.peer_id or peer_id in self._proven

    async def admit(self, peer_id: str) -> bool:
        """`allows`, once the peer's check has ended (at most ADMIT_TIMEOUT_S from now).

        For a protocol a peer uses right after connecting (the DHT: a joining node looks
        itself up at once), before this side has had time to check it.
        """
        if self.allows(peer_id):
            return True
        if self._banned(peer_id, time.time()):
            return False
        verdict = self._verdicts.setdefault(peer_id, trio.Event())
        with trio.move_on_after(ADMIT_TIMEOUT_S):
            await verdict.wait()
        return self.allows(peer_id)

    def _banned(self, peer_id: str, now: float) -> bool:
        """The peer, or an address it connects from (a fresh id of a repeat offender)."""
        if self._peers.is_banned(peer_id, now):
            return True
        return any(self._peers.is_address_banned(ip, now) for ip in remote_ips(self._host, peer_id))

    def _decided(self, peer_id: str) -> None:
        verdict = self._verdicts.pop(peer_id, None)
        if verdict is not None:
            verdict.set()

    async def watch(self) -> None:
        """Challenge every new connection; runs until cancelled, whatever a round meets."""
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    await self._watch_once(nursery)
                except Exception as exc:  # one bad round must not end the gate
                    self._errors.report("gate", exc)
                await trio.sleep(WATCH_INTERVAL_S)

    async def _watch_once(self, nursery: trio.Nursery) -> None:
        connected = set(self._host.connected_peers())
        self._proven &= connected  # a reconnection proves itself again
        for peer_id in [p for p in self._verdicts if p not in connected]:
            self._decided(peer_id)  # gone before its check: nobody waits on it
        now = time.time()
        for peer_id in connected - self._proven - self._pending:
            if self._banned(peer_id, now):
                await self._host.disconnect(peer_id)
                continue
            self._pending.add(peer_id)
            nursery.start_soon(self._check, peer_id)

    async def _check(self, peer_id: str) -> None:
        try:
            for attempt in range(2):
                try:
                    with trio.fail_after(AUTH_TIMEOUT_S):
                        await self._prove_to(peer_id)
                    self._proven.add(peer_id)
                    return
                except Exception as exc:
                    # trio may deliver the error inside a group: look inside.
                    wrong = first_of(exc, WrongProofError)
                    if wrong is not None:
                        await self._refuse(peer_id, str(wrong))
                        return
                    failed = first_of(exc, SwarmError) or first_of(exc, trio.TooSlowError)
                    if failed is None:
                        raise
                    # A peer that just connected may not serve the protocol yet: once more.
                    if attempt == 1:
                        await self._refuse(peer_id, f"did not prove the swarm key: {failed}")
                        return
                    await trio.sleep(RETRY_DELAY_S)
        except Exception as exc:  # one peer must never end the trio run
            self._errors.report("gate-check", exc)
            await self._refuse(peer_id, "swarm-key check failed")
        finally:
            self._pending.discard(peer_id)
            self._decided(peer_id)

    async def _prove_to(self, peer_id: str) -> None:
        me = self._host.peer_id
        async with await self._host.open_stream(peer_id, AUTH_PROTOCOL) as stream:
            reply = await stream.recv(AUTH_TIMEOUT_S)
            their_challenge = _bytes(reply, "challenge", CHALLENGE_BYTES, peer_id)
            mine = make_challenge()
            proof = prove(self._key, their_challenge, me, peer_id)
            await stream.send({"proof": proof, "challenge": mine})
            answer = _bytes(await stream.recv(AUTH_TIMEOUT_S), "proof", PROOF_BYTES, peer_id)
            if not check_proof(self._key, mine, peer_id, me, answer):
                raise WrongProofError(f"peer {peer_id[-8:]} answered with a wrong proof", peer_id)

    async def _answer(self, stream: FrameStream) -> None:
        peer_id, me = stream.peer_id, self._host.peer_id
        if self._peers.is_banned(peer_id, time.time()):
            await self._host.disconnect(peer_id)
            return
        challenge = make_challenge()
        try:
            with trio.fail_after(AUTH_TIMEOUT_S):
                await stream.send({"challenge": challenge})
                reply = await stream.recv(AUTH_TIMEOUT_S)
                proof = _bytes(reply, "proof", PROOF_BYTES, peer_id)
                theirs = _bytes(reply, "challenge", CHALLENGE_BYTES, peer_id)
                if not check_proof(self._key, challenge, peer_id, me, proof):
                    await self._refuse(peer_id, "sent a wrong swarm-key proof")
                    return
                self._proven.add(peer_id)
                self._decided(peer_id)
                await stream.send({"proof": prove(self._key, theirs, me, peer_id)})
        except Exception as exc:
            # `except*` would do, but cannot hold the early `return`s above; trio may
            # deliver a PeerError inside a group, and it must be refused all the same.
            refused = first_of(exc, PeerError)
            if refused is not None:
                await self._refuse(peer_id, str(refused))
            elif first_of(exc, trio.TooSlowError) is not None:
                log.debug("swarm-key exchange with %s timed out", peer_id[-8:])
            else:
                raise

    async def _refuse(self, peer_id: str, reason: str) -> None:
        self._proven.discard(peer_id)
        self._peers.ban(peer_id, reason, time.time(), addr=remote_ip(self._host, peer_id))
        self._decided(peer_id)
        log.warning("DIAG: peer refused peer=%s reason=%s", peer_id[-8:], safe_text(reason))
        await self._host.disconnect(peer_id)


class WrongProofError(PeerError):
    """The peer answered, with a proof of another key."""


def _bytes(message: dict[str, object], field: str, size: int, peer_id: str) -> bytes:
    value = message.get(field)
    if not isinstance(value, bytes) or len(value) != size:
        raise WrongProofError(f"peer {peer_id[-8:]} sent no valid '{field}'", peer_id)
    return value
