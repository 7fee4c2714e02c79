"""Models: from a file on disk to a stage that runs a layer range.

- `source.py`        `resolve_model`: embedded id, GGUF file or Hugging Face folder -> a
                     source (a GGUF: its metadata folder, config, tokenizer and tensor
                     index, read once; `resolve_folder` converts it for `swarmd shard`)
- `gguf_index.py`    `GgufEntry`: where each tensor's bytes are in a GGUF file
- `gguf_tensors.py`  `GgufTensors`: a GGUF's tensors read in place from a memory map;
                     `MappedRows`: an embedding table read row by row from the file
- `gguf_convert.py`  `plan` / `stored_matrix`: what each GGUF tensor is held as (Q4 blocks
                     as int4 exactly, Q4_0 kept as blocks for the block kernel, the rest
                     requantized); `write_converted`: a converted folder
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
