"""Model files between peers: serving them and fetching them (above dht/: a fetch finds
its holders through their signed records).

- `files.py`     `FileServer`: a holder serves its manifest and shard files (RPC methods
                 `manifest`, `file_chunk`; transfer caps in all and per peer, upload
                 limit); `call_file_chunk`
- `fetch.py`     `Fetcher`: downloads files chunk by chunk, checked, resumable, from holders
"""
