"""Stop strings, streaming detokenization and chat prompts, against the real SmolLM2 tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from swarmd.model.text import ChatMessage, IncrementalDetokenizer, StopMatcher, TextCodec
from swarmd.model.token_bytes import byte_level_chars

REPLACEMENT = "\ufffd"


def stream(matcher: StopMatcher, deltas: list[str]) -> list[str]:
    """What a client sees: one emission per delta, then the flush."""
    return [matcher.feed(d) for d in deltas] + [matcher.flush()]


# --- StopMatcher -------------------------------------------------------------------------


def test_stop_inside_one_delta_cuts_before_it() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("hello STOP world") == "hello "
    assert matcher.stopped


def test_stop_at_the_very_start() -> None:
    matcher = StopMatcher(["\n\n"])
    assert stream(matcher, ["\n\nanswer"]) == ["", ""]
    assert matcher.stopped


def test_stop_split_across_deltas_is_never_shown() -> None:
    matcher = StopMatcher(["<END>"])
    out = stream(matcher, ["abc <", "E", "N", "D> tail"])
    assert out == ["abc ", "", "", "", ""]
    assert "".join(out) == "abc "
    assert matcher.stopped


def test_stop_prefix_that_diverges_is_released_intact() -> None:
    matcher = StopMatcher(["<END>"])
    assert matcher.feed("x <E") == "x "  # "<E" could start the stop string: held
    assert not matcher.stopped
    assert matcher.feed("N") == ""  # "<EN" still could
    assert matcher.feed("Dless") == "<ENDless"  # "<ENDl" cannot: all of it comes out
    assert not matcher.stopped


def test_diverging_prefix_comes_out_whole_and_in_order() -> None:
    matcher = StopMatcher(["<END>"])
    out = stream(matcher, ["x <E", "N", "X> y"])
    assert out == ["x ", "", "<ENX> y", ""]
    assert not matcher.stopped


def test_held_prefix_can_restart_a_new_match() -> None:
    # "aab": the first "a" is released when "aa" turns out not to be "ab", but the second
    # "a" may still start the stop string.
    matcher = StopMatcher(["ab"])
    assert matcher.feed("a") == ""
    assert matcher.feed("a") == "a"
    assert matcher.feed("b and more") == ""
    assert matcher.stopped


def test_several_stops_cut_at_the_earliest() -> None:
    matcher = StopMatcher(["world", "lo"])
    assert matcher.feed("hello world") == "hel"
    matcher = StopMatcher(["lo", "hello"])
    assert matcher.feed("say hello") == "say "


def test_several_stops_split_across_deltas() -> None:
    matcher = StopMatcher(["###", "</s>"])
    out = stream(matcher, ["one #", "# two </", "s>"])
    # "##" then " two" diverges from "###"; "</" is held and completed to "</s>".
    assert out == ["one ", "## two ", "", ""]
    assert matcher.stopped


@pytest.mark.parametrize("stops", [[], [""]])
def test_no_stops_pass_everything_through(stops: list[str]) -> None:
    matcher = StopMatcher(stops)
    deltas = ["a", "", "<E", "ND>", " \n\n", "ü"]
    assert stream(matcher, deltas) == [*deltas, ""]
    assert not matcher.stopped


def test_flush_releases_held_text() -> None:
    matcher = StopMatcher(["<END>"])
    assert matcher.feed("the end <EN") == "the end "
    assert matcher.flush() == "<EN"
    assert matcher.flush() == ""  # only once
    assert not matcher.stopped


def test_nothing_comes_out_after_a_stop() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("a STOP b ST") == "a "
    assert matcher.feed("more text") == ""
    assert matcher.feed("STOP again") == ""
    assert matcher.flush() == ""
    assert matcher.stopped


def test_multibyte_stop_string() -> None:
    matcher = StopMatcher(["🛑"])
    assert stream(matcher, ["日本", "語🛑", "après"]) == ["日本", "語", "", ""]


# --- TextCodec ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def codec(smollm_dir: Path) -> TextCodec:
    return TextCodec.load(smollm_dir)


def token_id(codec: TextCodec, token: str) -> int:
    found = codec.tokenizer.token_to_id(token)
    assert isinstance(found, int), token
    return found


def test_eos_ids_contain_im_end(codec: TextCodec) -> None:
    assert token_id(codec, "<|im_end|>") in codec.eos_ids


def test_has_chat_template(codec: TextCodec) -> None:
    assert codec.has_chat_template


@pytest.fixture(scope="module")
def reference(smollm_dir: Path) -> Any:
    """transformers' own tokenizer of the same folder (what the codec must equal)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_dir))


CONVERSATIONS = [
    [
        ChatMessage("system", "You are a terse assistant."),
        ChatMessage("user", "Name a colour, in 日本語 or français."),
    ],
    [ChatMessage("user", "Hi")],
    [
        ChatMessage("user", "2+2?"),
        ChatMessage("assistant", "4"),
        ChatMessage("user", "And {{ 3 }} + <b>3</b>?"),
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_prompt_matches_apply_chat_template(
    codec: TextCodec, reference: Any, messages: list[ChatMessage]
) -> None:
    rendered = reference.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = codec.chat_prompt(messages)
    assert prompt == reference.encode(rendered, add_special_tokens=False)
    # The prompt opens the assistant's turn and does not close it.
    tail = codec.tokenizer.decode(prompt[-4:], skip_special_tokens=False)
    assert tail.endswith("<|im_start|>assistant\n")
    turns = len(messages) + (messages[0].role != "system") + 1  # the default system turn
    assert prompt.count(token_id(codec, "<|im_start|>")) == turns


TEXTS = ["Hello world", "  two leading spaces", "Crème brûlée, 中文, 🎉", "<|im_end|> raw", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(codec: TextCodec, reference: Any, text: str) -> None:
    ids = codec.encode(text)
    assert ids == reference.encode(text, add_special_tokens=True)
    assert codec.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_decode_round_trips_and_skips_special_tokens(codec: TextCodec) -> None:
    text = "Crème brûlée, 中文, 🎉"
    ids = codec.encode(text)
    assert codec.decode(ids) == text
    assert codec.decode([*ids, token_id(codec, "<|im_end|>")]) == text


# --- IncrementalDetokenizer --------------------------------------------------------------


MULTIBYTE_TEXTS = [
    "Hello 👋🏽 world 🎉!",
    "🤖🤖🤖",
    "日本語のテキスト、漢字とかな。",
    "中文测试：你好，世界！",
    "Crème brûlée à la café, naïve façade, Ærøskøbing",
    "mixed: ñ 中 😀 é\n\nend  two  spaces ",
    "combining a\u0301 e\u0301 and a family 👨‍👩‍👧",
    "plain ASCII, with punctuation: don't , stop . ?",
]


def byte_token_ids(codec: TextCodec, text: str) -> list[int]:
    """One token per UTF-8 byte: what a model emits when it spells a character bytewise."""
    table = byte_level_chars()
    return [token_id(codec, table[b]) for b in text.encode("utf-8")]


def detokenize(codec: TextCodec, ids: list[int]) -> list[str]:
    """Every delta, the flush last."""
    detok = IncrementalDetokenizer(codec)
    return [detok.add(t) for t in ids] + [detok.flush()]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_deltas_join_to_the_full_decode(codec: TextCodec, text: str) -> None:
    ids = codec.encode(text)
    deltas = detokenize(codec, ids)
    assert "".join(deltas) == codec.decode(ids) == text
    assert not any(REPLACEMENT in d for d in deltas)


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_bytewise_tokens_join_to_the_full_decode(codec: TextCodec, text: str) -> None:
    ids = byte_token_ids(codec, text)
    deltas = detokenize(codec, ids)
    assert "".join(deltas) == codec.decode(ids) == text
    assert not any(REPLACEMENT in d for d in deltas)


def test_a_character_comes_out_with_its_last_byte(codec: TextCodec) -> None:
    # é is 2 bytes, 😀 is 4: nothing until the character is complete, then all of it.
    deltas = detokenize(codec, byte_token_ids(codec, "aé😀b"))
    assert deltas == ["a", "", "é", "", "", "", "😀", "b", ""]


def test_special_tokens_add_no_text(codec: TextCodec) -> None:
    ids = [*codec.encode("Hi 👋"), token_id(codec, "<|im_end|>")]
    deltas = detokenize(codec, ids)
    assert "".join(deltas) == "Hi 👋"
    assert "<|im_end|>" not in "".join(deltas)


def test_flush_of_an_unfinished_character_matches_decode(codec: TextCodec) -> None:
    # A reply cut (max_tokens) in the middle of a 4-byte emoji: the flush gives what
    # decode gives, so the stream and the non-stream reply agree.
    ids = byte_token_ids(codec, "ok 😀")[:-2]
    deltas = detokenize(codec, ids)
    assert not any(REPLACEMENT in d for d in deltas[:-1])
    assert "".join(deltas) == codec.decode(ids)


def test_detokenizer_and_stop_matcher_together(codec: TextCodec) -> None:
    ids = codec.encode("Réponse: 42 🎉 <END> ignored")
    detok = IncrementalDetokenizer(codec)
    matcher = StopMatcher(["<END>"])
    shown = ""
    for t in ids:
        shown += matcher.feed(detok.add(t))
        if matcher.stopped:
            break
    assert matcher.stopped
    assert shown == "Réponse: 42 🎉 "
