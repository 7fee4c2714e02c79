"""Models: from a file on disk to a stage that runs a layer range.

- `source.py`    `resolve_model`: embedded id, GGUF file or Hugging Face folder -> folder
                 (GGUF converted once into the user cache, under a lock)
- `loader.py`    `LoadedModel`, `load_model`: config + stage + tokenizer of one model
                 (a sharded model's files are verified against its manifest first)
- `manifest.py`  `Manifest`: shards, hashes, content id; `parse_manifest` (untrusted input)
- `shards.py`    `write_shards` (`swarmd shard`), `hash_file`, `verify_files`
- `memory.py`    per-layer weight bytes and free memory, for `--layers auto`
- `layers.py`    `LayerRange` [start, end)
- `families.py`  which transformers classes build a stage of each architecture
- `stage.py`     `StageModule` (layers [start, end), renumbered) and `load_stage`
- `runtime.py`   `StageRuntime`: a stage's sessions, each with its KV cache and sampler
- `sampling.py`  `SamplingParams`, the filters, `Sampler`
- `text.py`      `TextCodec` (tokenizer, chat prompt), `IncrementalDetokenizer`, `StopMatcher`
- `worker.py`    `TorchWorker`: the one thread that runs torch
"""
