"""The stage engine: swarmd's own forward for the Llama family and Gemma 3.

- `arch.py`    `ArchSpec`: what the forward needs of a config, per family (no transformers)
- `linear.py`  held matrices (`Dense`, `Int8`, `Int4`: torch's CPU kernels; `Int4Dot`,
               `Int8Dot`: swarmd's) and `Projection`, which fuses q/k/v and gate/up
- `native.py`  swarmd's int4 / int8 kernels (`bf16_dot.cpp`): built with g++, loaded
               where the CPU has avx512_bf16, else None (torch's serve); and the GGUF
               block kernel (`blocks.cpp`: Q4_0 as the file holds it, Q6_K -> int8),
               where the CPU has AVX2
- `rope.py`    `RopeTable`: rotary cos/sin from a table grown on demand
- `kv.py`      `KVCache`: one session's keys and values, one buffer grown in place
- `stage.py`   `LeanStage`: layers [start, end), prefill and decode, `view` of a sub-range
- `scripted.py` `DecodeLoop`: a decode step's layer loop as TorchScript, bit for bit the
               eager loop at a third of its per-op overhead
- `load.py`    `load_lean_stage`: a stage from safetensors or a GGUF read in place, by a
               plain name table
"""
