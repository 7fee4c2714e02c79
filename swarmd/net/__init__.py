"""Networking: who this node is and how it talks to peers.

- `identity.py`  `Identity` (Ed25519 key, libp2p peer id, short id), `verify`,
                 `load_or_create_identity` (the 0600 key file in the data dir)
The libp2p host, framing and remote calls land here with the swarm layer.
"""
