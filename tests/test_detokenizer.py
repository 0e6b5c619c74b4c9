import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.tiny_model import CORPUS_PATH
from engine.tokenizer import Tokenizer

VOCAB = 512
SPECIAL_IDS = [0, 1, 2, 3]


class ByteDecoder:
    """Ids 0..255 are bytes, decoded like byte-level BPE (lossy UTF-8); ids >= 256 are special tokens."""

    def decode(self, ids, skip_special_tokens=True):
        out = bytearray()
        for token_id in ids:
            if token_id < 256:
                out.append(token_id)
            elif not skip_special_tokens:
                out += f"<s{token_id}>".encode()
        return out.decode("utf-8", errors="replace")


class WordDecoder:
    """Sentencepiece-like: tokens are strings, "▁" is a space, and the text's leading space is stripped."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")


class CountingDecoder:
    """Records how many ids each decode call sees."""

    def __init__(self, inner):
        self.inner = inner
        self.sizes = []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def utf8(text: str) -> list[int]:
    return list(text.encode())


def run(detokenizer: IncrementalDetokenizer, ids) -> list[str]:
    return [detokenizer.add_token(token_id) for token_id in ids]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return Tokenizer.from_dir(tiny_llama_dir)


def reference_stop(text: str, stops, include: bool):
    """The stop string that ends first in the final text (the longer on a tie), and the text cut at it."""
    matches = [(text.find(stop) + len(stop), text.find(stop), stop) for stop in stops if stop in text]
    if not matches:
        return text, None
    end, start, stop = min(matches)
    return text[: end if include else start], stop


def test_a_character_is_emitted_only_when_its_last_byte_arrives():
    detokenizer = IncrementalDetokenizer(ByteDecoder(), [])
    assert run(detokenizer, utf8("a中😀b")) == ["a", "", "", "中", "", "", "", "😀", "b"]
    assert detokenizer.flush() == ""
    assert detokenizer.text == "a中😀b"


def test_real_tokens_that_end_mid_character_yield_nothing_until_it_completes(tokenizer):
    ids = tokenizer.encode("中文 😀 Αθήνα!", add_special_tokens=False)
    deltas = run(IncrementalDetokenizer(tokenizer, []), ids)
    assert "".join(deltas) == "中文 😀 Αθήνα!"
    assert "" in deltas and not any("\ufffd" in delta for delta in deltas)
    for i, delta in enumerate(deltas):  # a token is silent exactly when the text so far ends mid-character
        assert (delta == "") is tokenizer.decode(ids[: i + 1]).endswith("\ufffd")


def test_trailing_incomplete_character_is_flushed_as_replacement_character():
    detokenizer = IncrementalDetokenizer(ByteDecoder(), [])
    assert run(detokenizer, [ord("a"), 0xE4, 0xB8]) == ["a", "", ""]
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.text == "a\ufffd" == ByteDecoder().decode([ord("a"), 0xE4, 0xB8])
    assert detokenizer.finished and detokenizer.add_token(ord("x")) == "" and detokenizer.flush() == ""


def test_invalid_bytes_become_replacement_characters_once_a_later_byte_settles_them():
    detokenizer = IncrementalDetokenizer(ByteDecoder(), [])
    assert run(detokenizer, [0x80, 0x80, ord("a"), 0xE4, ord("b")]) == ["", "", "\ufffd\ufffda", "", "\ufffdb"]


def test_stop_string_holds_back_its_possible_start_and_cuts_before_it():
    detokenizer = IncrementalDetokenizer(ByteDecoder(), [], stop=["###"])
    assert run(detokenizer, utf8("a##b###c")) == ["a", "", "", "##b", "", "", "", ""]
    assert (detokenizer.text, detokenizer.stop_matched, detokenizer.finished) == ("a##b", "###", True)
    assert detokenizer.flush() == ""


def test_stop_string_included_in_output_when_asked():
    detokenizer = IncrementalDetokenizer(ByteDecoder(), [], stop="###", include_stop_str_in_output=True)
    assert run(detokenizer, utf8("a##b###c")) == ["a", "", "", "##b", "", "", "###", ""]
    assert (detokenizer.text, detokenizer.stop_matched) == ("a##b###", "###")


def test_held_back_start_of_a_stop_string_is_released_by_flush():
    detokenizer = IncrementalDetokenizer(ByteDecoder(), [], stop=["###"])
    assert run(detokenizer, utf8("ab#")) == ["a", "b", ""]
    assert detokenizer.flush() == "#"
    assert (detokenizer.text, detokenizer.stop_matched) == ("ab#", None)


def test_stop_string_spanning_real_tokens(tokenizer):
    ids = tokenizer.encode("Hello world, stop here please", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["stop here"])
    deltas = run(detokenizer, ids)
    assert "".join(deltas) == detokenizer.text == "Hello world, "
    assert detokenizer.stop_matched == "stop here"


@pytest.mark.parametrize("chunks", [["xabcdef"], list("xabcdef"), ["xab", "cdef"]])
def test_the_stop_string_that_ends_first_wins_however_the_text_is_split(chunks):
    decoder = WordDecoder(chunks)
    detokenizer = IncrementalDetokenizer(decoder, [], stop=["abcde", "bcd"])
    run(detokenizer, range(len(chunks)))
    assert (detokenizer.text, detokenizer.stop_matched) == ("xa", "bcd")


def test_on_a_tie_the_longer_stop_string_wins():
    detokenizer = IncrementalDetokenizer(WordDecoder(["abcd"]), [], stop=["cd", "bcd"])
    assert run(detokenizer, [0]) == ["a"]
    assert detokenizer.stop_matched == "bcd"


def test_the_prompt_gives_the_first_token_its_leading_space():
    """Sentencepiece strips a text's leading space; decoding after the prompt's last tokens keeps the space the
    model generated (as vLLM does)."""
    decoder = WordDecoder(["▁Hello", "▁world", "!"])
    with_prompt = IncrementalDetokenizer(decoder, [0])
    assert run(with_prompt, [1, 2]) == [" world", "!"]
    without_prompt = IncrementalDetokenizer(decoder, [])
    assert run(without_prompt, [1, 2]) == ["world", "!"]


def test_a_prompt_ending_mid_character_is_not_used_as_context():
    detokenizer = IncrementalDetokenizer(ByteDecoder(), utf8("ab") + [0xE4])
    deltas = run(detokenizer, [0xB8, 0xAD, ord("c")])
    assert "".join(deltas) + detokenizer.flush() == ByteDecoder().decode([0xB8, 0xAD, ord("c")]) == "\ufffd\ufffdc"


def test_special_tokens_are_skipped_or_shown(tokenizer):
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [3, 1]
    skipped = IncrementalDetokenizer(tokenizer, [0, 2])
    assert "".join(run(skipped, ids)) + skipped.flush() == "Hi"
    shown = IncrementalDetokenizer(tokenizer, [0, 2], skip_special_tokens=False)
    assert "".join(run(shown, ids)) + shown.flush() == "Hi<|im_end|><|end_of_text|>"


def test_each_token_decodes_a_short_window_not_the_whole_output(tokenizer):
    counting = CountingDecoder(tokenizer)
    ids = tokenizer.encode(CORPUS_PATH.read_text(encoding="utf-8"), add_special_tokens=False)
    assert len(ids) > 1500
    detokenizer = IncrementalDetokenizer(counting, list(range(4, 100)), stop=["never appears"])
    deltas = run(detokenizer, ids)
    assert "".join(deltas) + detokenizer.flush() == tokenizer.decode(ids)
    assert max(counting.sizes) <= 12


def test_a_long_run_of_skipped_special_tokens_does_not_grow_the_window(tokenizer):
    counting = CountingDecoder(tokenizer)
    detokenizer = IncrementalDetokenizer(counting, [])
    ids = tokenizer.encode("a", add_special_tokens=False) + [2] * 500 + tokenizer.encode("b", add_special_tokens=False)
    assert "".join(run(detokenizer, ids)) == "ab"
    assert max(counting.sizes) <= 3


@pytest.mark.parametrize("stop", [[""], ["ok", ""], [None]])
def test_empty_stop_strings_are_rejected(stop):
    with pytest.raises(ValueError, match="every stop string must be a non-empty str"):
        IncrementalDetokenizer(ByteDecoder(), [], stop=stop)


token_ids = st.lists(st.integers(0, VOCAB - 1) | st.sampled_from(SPECIAL_IDS), max_size=40)


@settings(max_examples=200, deadline=None)
@given(prompt=token_ids, output=token_ids, skip=st.booleans())
def test_deltas_and_flush_concatenate_to_decode(tokenizer, prompt, output, skip):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas = run(detokenizer, output)
    assert "".join(deltas) + detokenizer.flush() == tokenizer.decode(output, skip_special_tokens=skip)
    assert detokenizer.text == tokenizer.decode(output, skip_special_tokens=skip)
    assert detokenizer.stop_matched is None


@settings(max_examples=200, deadline=None)
@given(output=token_ids, skip=st.booleans(), include=st.booleans(), data=st.data())
def test_stop_strings_cut_the_text_like_a_search_of_the_final_text(tokenizer, output, skip, include, data):
    full = tokenizer.decode(output, skip_special_tokens=skip)
    stops = data.draw(st.lists(st.text(alphabet="ab é中", min_size=1, max_size=3), max_size=2))
    for _ in range(data.draw(st.integers(0, 2)) if full else 0):
        start = data.draw(st.integers(0, len(full) - 1))
        stops.append(full[start : start + data.draw(st.integers(1, 6))])
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip, stop=stops,
                                         include_stop_str_in_output=include)
    deltas = run(detokenizer, output)
    deltas.append(detokenizer.flush())
    expected_text, expected_stop = reference_stop(full, list(dict.fromkeys(stops)), include)
    assert "".join(deltas) == detokenizer.text == expected_text
    assert detokenizer.stop_matched == expected_stop


def test_min_tokens_lets_stop_strings_through_until_more_tokens_than_it_were_added(tokenizer):
    ids = tokenizer.encode("ab ab ab")
    full = tokenizer.decode(ids)
    checked = 0
    for min_tokens in range(len(ids) + 1):
        detok = IncrementalDetokenizer(tokenizer, [1], stop=["b"], min_tokens=min_tokens)
        text = "".join(detok.add_token(t) for t in ids) + detok.flush()
        head = tokenizer.decode(ids[:min_tokens])
        if not full.startswith(head):
            continue
        # the first min_tokens tokens' text is let through whole; the first "b" after it ends the text
        cut = full.find("b", len(head))
        assert text == (full if cut < 0 else full[:cut]), min_tokens
        assert detok.stop_matched == (None if cut < 0 else "b")
        checked += 1
    assert checked >= 3
