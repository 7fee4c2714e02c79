"""Discovery: signed records of who serves which layers, on the Kademlia DHT.

- `records.py`    `NodeRecord`, `sign_record`, `decode_record` (every check a peer's
                  record must pass), `record_key` / `model_key` (DHT keys <= 50 bytes)
- `index.py`      `IndexRecord`: the models one node lists in the swarm's catalog;
                  `sign_index` / `decode_index`, `catalog_key` / `index_key`, `catalog`
- `discovery.py`  `open_discovery` / `Discovery`: bootstrap, announce, withdraw, and
                  `holders(model_id)`; `RecordValidator` for the "swarmd" namespace
- `swarm.py`      `SwarmPresence`: host + DHT + announcements for one node (trio side);
                  above net/ because it runs discovery
"""
