"""Logprobs in OpenAI's chat and completions shapes, and the bytes behind each token."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from swarmd.api.logprobs import LogprobsWriter
from swarmd.model.sampling import TokenLogprobs
from swarmd.model.token_bytes import TokenBytes


def byte_level_tokenizer() -> Tokenizer:
    """A tiny byte-level BPE: every byte its own token, plus 'Ġhi' (' hi')."""
    vocab = {ch: i for i, ch in enumerate(sorted(set(pre_tokenizers.ByteLevel.alphabet())))}
    vocab["Ġh"] = len(vocab)
    vocab["Ġhi"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [("Ġ", "h"), ("Ġh", "i")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_byte_level_tokens_give_their_bytes_even_mid_character() -> None:
    tok = byte_level_tokenizer()
    tb = TokenBytes(tok)
    ids = tok.encode("ok hi é").ids
    pieces = [tb(i) for i in ids]
    assert b"".join(pieces) == "ok hi é".encode()
    assert b" hi" in pieces
    assert pieces[-2:] == [b"\xc3", b"\xa9"]  # é split in two: each half its byte
    assert tb.text(ids[-1]) == "\ufffd"


def test_metaspace_tokens_give_spaces_and_raw_bytes() -> None:
    vocab = {"<unk>": 0, "\u2581hi": 1, "<0x0A>": 2, "a": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback()])
    tb = TokenBytes(tok)
    assert (tb(1), tb(2), tb(3)) == (b" hi", b"\n", b"a")


LP = [(1, TokenLogprobs(-0.25, ((1, -0.25), (3, -1.5)))), (3, TokenLogprobs(-2.0, ()))]


class Bytes:
    """Token id -> bytes, for the writer."""

    table: ClassVar[dict[int, bytes]] = {1: b"He", 3: b"llo"}

    def __call__(self, token: int) -> bytes:
        return self.table[token]

    def text(self, token: int) -> str:
        return self.table[token].decode()


def test_the_chat_shape() -> None:
    out = LogprobsWriter("chat", Bytes()).format(LP)  # type: ignore[arg-type]
    assert out == {
        "content": [
            {
                "token": "He",
                "logprob": -0.25,
                "bytes": [72, 101],
                "top_logprobs": [
                    {"token": "He", "logprob": -0.25, "bytes": [72, 101]},
                    {"token": "llo", "logprob": -1.5, "bytes": [108, 108, 111]},
                ],
            },
            {"token": "llo", "logprob": -2.0, "bytes": [108, 108, 111], "top_logprobs": []},
        ],
        "refusal": None,
    }


def test_the_completions_shape_counts_offsets_across_chunks() -> None:
    writer = LogprobsWriter("text", Bytes())  # type: ignore[arg-type]
    first = writer.format(LP[:1])
    second = writer.format(LP[1:])
    assert first == {
        "tokens": ["He"],
        "token_logprobs": [-0.25],
        "top_logprobs": [{"He": -0.25, "llo": -1.5}],
        "text_offset": [0],
    }
    assert second["text_offset"] == [2] and second["tokens"] == ["llo"]


def test_each_choice_counts_its_own_text_offsets() -> None:
    writer = LogprobsWriter("text", Bytes())  # type: ignore[arg-type]
    # two choices streamed interleaved: each counts from the start of its own text
    assert writer.format(LP[:1], 0)["text_offset"] == [0]
    assert writer.format(LP, 1)["text_offset"] == [0, 2]
    assert writer.format(LP[1:], 0)["text_offset"] == [2]
    assert writer.format(LP[:1], 1)["text_offset"] == [5]


def test_the_embedded_models_tokens_rebuild_any_text(smollm_dir: Path) -> None:
    tok = Tokenizer.from_file(str(smollm_dir / "tokenizer.json"))
    tb = TokenBytes(tok)
    text = "Grüße, 世界! ok\n\tdone 🎉"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert b"".join(tb(i) for i in ids).decode() == text
