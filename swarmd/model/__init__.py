"""Models: from a file on disk to a stage that runs a layer range.

- `source.py`        `resolve_model`: embedded id, GGUF file or Hugging Face folder -> folder
                     (a GGUF converted once per weight format into the user cache)
- `gguf_convert.py`  `write_converted`: a GGUF's config, tokenizer and weights (Q4 blocks
                     taken as int4 exactly, the rest requantized once)
- `quant.py`         int4 / int8 matrices: from GGUF blocks, from floats, stored form,
                     `convert`, `StoredTensors` (a checkpoint's tensors by name)
- `tensorfile.py`    safetensors read and written one tensor at a time (no memory map)
- `loader.py`        `LoadedModel`, `load_model`: config + stage + tokenizer of one model,
                     on the engine or the exact transformers path
- `manifest.py`      `Manifest`: shards, hashes, content id; `parse_manifest` (untrusted)
- `shards.py`        `write_shards` (`swarmd shard`, any `--weights`)
- `hashing.py`       `hash_file`, `file_sha256`, `verify_files` against a manifest
- `memory.py`        per-layer held bytes and free memory (`--layers auto`); the C heap
- `layers.py`        `LayerRange` [start, end)
- `families.py`      which transformers classes build an exact-path stage
- `stage.py`         `StageModule` (transformers modules, layers renumbered), `load_stage`
- `runtime.py`       `Stage` (what a runtime runs), `StageRuntime`: sessions and samplers
- `sampling.py`      `SamplingParams`, `TokenLogprobs`, `Sampled`, seeds per position and
                     choice (no torch: a coordinator's)
- `sampler.py`       the filters and `Sampler` (torch: the last stage's)
- `grammar.py`       structured outputs (llguidance): `GrammarSpec`, `Constraint`
- `token_bytes.py`   each token's bytes (logprobs' `bytes`)
- `tool_prompt.py`   offering tools: checks, families, the prompt (template or fallback)
- `tool_calls.py`    reading calls from a reply, whole or streamed
- `text.py`          `TextCodec` (tokenizers + chat prompt), `IncrementalDetokenizer`,
                     `StopMatcher`; `chat_template.py` renders templates as transformers
- `worker.py`        `TorchWorker`: the one thread that runs torch, typed jobs; waited on
                     from asyncio there and from trio in `worker_trio.py`
- `threads.py`       torch threads: one per physical core, on the worker thread alone
"""
