"""`CommonModel`: a model this node coordinates without holding any of its layers.

What a coordinator needs of a model is its common files: the config (in the manifest)
and the tokenizer and chat template, taken from a holder once and checked against the
content id. Prompts are tokenized, replies detokenized and grammars compiled here; every
layer runs on the swarm's holders of the same content id, weights and dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from swarmd.errors import ModelLoadError
from swarmd.model.grammar import GrammarSpec, Vocabulary, compile_grammar
from swarmd.model.hashing import verify_files
from swarmd.model.layers import LayerRange
from swarmd.model.source import ModelSource
from swarmd.model.text import TextCodec


def config_num_layers(config: dict[str, Any]) -> int:
    return int(config["num_hidden_layers"])


def config_context_length(config: dict[str, Any]) -> int:
    """The context a config allows (2048 when it names none)."""
    return int(config.get("max_position_embeddings") or 2048)


@dataclass(frozen=True)
class Variant:
    """One way a model is held: holders of one variant can share a route."""

    content_id: str
    weights: str
    dtype_name: str


@dataclass(frozen=True)
class CommonModel:
    model_id: str
    source: ModelSource  # the cache folder of the common files, with the manifest
    config: dict[str, Any]
    variant: Variant
    codec: TextCodec

    @classmethod
    def load(cls, source: ModelSource, variant: Variant) -> CommonModel:
        """From a folder holding the manifest's common files (hashed here first)."""
        manifest = source.manifest
        if manifest is None or manifest.content_id != variant.content_id:
            raise ModelLoadError(f"{source.model_dir} has no manifest of {variant.content_id}")
        verify_files(source.model_dir, manifest.files)
        config = dict(manifest.config)
        for key in ("num_hidden_layers", "vocab_size"):
            if not isinstance(config.get(key), int):
                raise ModelLoadError(f"the manifest of {source.model_id} has no {key}")
        return cls(source.model_id, source, config, variant, TextCodec.load(source.model_dir))

    @property
    def num_layers(self) -> int:
        return config_num_layers(self.config)

    @property
    def context_length(self) -> int:
        return config_context_length(self.config)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def layers(self) -> LayerRange:
        return LayerRange(0, 0)  # none held here

    @property
    def is_whole(self) -> bool:
        return False

    @functools.cached_property
    def grammar_vocabulary(self) -> Vocabulary:
        return Vocabulary(self.codec.tokenizer, self.vocab_size, self.codec.eos_ids)

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Compile `spec` (a 400 naming its parameter if it does not): the last stage, on
        a holder, compiles it again for the reply."""
        compile_grammar(spec, self.grammar_vocabulary)
