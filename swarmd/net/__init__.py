"""Networking: who this node is and how it talks to peers.

- `identity.py`  `Identity` (Ed25519 key, libp2p peer id, short id), `verify`,
                 `load_or_create_identity` (the 0600 key file in the data dir)
- `bridge.py`    `TrioBridge`: py-libp2p (trio) in its own thread beside the asyncio
                 loop; the only module that imports both
- `host.py`      `open_host` / `P2PHost`: libp2p with Noise only and yamux
- `noise_writes.py`, `yamux_tuning.py`  fixes to py-libp2p's Noise and yamux, applied
                 when `host` is imported
- `quick_locks.py` `QuickLock`: free locks on a frame's path taken without a scheduler
                 pass (py-libp2p's TCP stream, yamux and net stream; `FrameStream`)
- `frames.py`    the wire codec (length prefix + msgpack, hard limits), `FrameStream`
- `rpc.py`       `RpcService` (handler side) and `call` / `call_ping` (caller side)
- `peers.py`     `PeerTable`: RTT, last seen, failures, bans with growing backoff
- `auth.py`      the private-swarm proof: `SwarmKey`, `prove`, `check_proof`
- `gate.py`      `SwarmGate`: runs that proof on every new connection, bans who fails
- `safe_text.py` `safe_text`: a peer's string as one capped, printable log line
- `loop_errors.py` `LoopErrors`: background-loop errors counted and logged sparingly;
                 `leaves` / `first_of` see through trio's exception groups
- `remote_addr.py` `remote_ips`: the IPs a connected peer reaches us from (address bans)
- `private_file.py` `read_private_file`: key files must be regular, private, small
- `progress.py`  `RichProgress`: the terminal progress bar of a fetch
"""
