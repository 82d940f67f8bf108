"""Tokenizers of decoder artifacts: text from tokens one at a time (never half a UTF-8
character), stop strings, and a ``tokenizer.json`` carried by an artifact."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pxrt
from pxrt import demo
from pxrt.tokenizer import ByteTokenizer, TextStream, TokenizersTokenizer

TEXTS = ["plain ascii", "é€ and ✓ and 😀", "日本語のテキスト", ""]


def stream_all(tokenizer, tokens, stop=()):
    out = TextStream(tokenizer, stop)
    pieces = [out.push(t) for t in tokens]
    pieces.append(out.flush())
    return pieces, out


@pytest.mark.parametrize("text", TEXTS)
def test_bytes_never_emit_half_a_character(text):
    tok = ByteTokenizer()
    pieces, out = stream_all(tok, tok.encode(text))
    assert "".join(pieces) == text == out.text
    assert all("\ufffd" not in p for p in pieces)
    # A multi-byte character comes out whole, in the piece of its last byte.
    assert sum(1 for p in pieces if p) == len(text)


def test_special_tokens_have_no_text_and_bad_bytes_are_replaced():
    tok = ByteTokenizer()
    pieces, _ = stream_all(tok, [72, demo.LM_EOS, 0xC3, 105])  # 0xC3 then ASCII: broken
    assert "".join(pieces) == "H\ufffdi"


@pytest.mark.parametrize(
    "text, stop, want",
    [
        ("hello world", ["wor"], "hello "),
        ("hello world", ["xyz"], "hello world"),
        ("hello world", ["o w", "ll"], "he"),  # the first stop in the text wins
        ("abcabc", ["ca"], "ab"),
        ("é€✓", ["€"], "é"),
    ],
)
def test_stop_strings_cut_the_text_even_across_tokens(text, stop, want):
    tok = ByteTokenizer()
    pieces, out = stream_all(tok, tok.encode(text), stop)
    assert "".join(pieces) == want == out.text
    assert out.stopped == (want != text)


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot():
    tok = ByteTokenizer()
    out = TextStream(tok, ["world"])
    assert [out.push(t) for t in tok.encode("hello wo")] == list("hello ") + ["", ""]
    assert out.push(ord("x")) == "wox"  # no longer a prefix of "world": released


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abé€ ", max_size=40),
    stops=st.lists(st.text(alphabet="abé€ ", min_size=1, max_size=6), max_size=4),
)
def test_stop_strings_against_a_plain_reference(text, stops):
    """Token by token, what is emitted is the text up to the first stop string to
    complete, and what is held back is exactly the longest end that could begin one."""
    tok = ByteTokenizer()
    out = TextStream(tok, stops)
    first = len(text)
    for end in range(len(text) + 1):
        hits = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if hits:
            first = min(hits)
            break
    emitted = ""
    tokens = tok.encode(text)
    for i, t in enumerate(tokens):
        emitted += out.push(t)
        if out.stopped:
            break
        decoded = tok.decode(tokens[: i + 1])
        held = decoded[len(emitted) :] if decoded.startswith(emitted) else None
        if held is not None and "\ufffd" not in decoded:  # (a whole character so far)
            could = max(
                (k for s in stops for k in range(1, len(s)) if decoded.endswith(s[:k])),
                default=0,
            )
            assert len(held) == could, (decoded, emitted, stops)
    emitted += out.flush()
    assert emitted == text[:first] == out.text
    assert out.stopped == (first < len(text))


def _bpe(tmp_path, vocab: int) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(["hello world, hello pxrt", "é€✓ 日本語"] * 20, trainer)
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    return path


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizers_stream_equals_the_whole_decode(tmp_path, text):
    tok = TokenizersTokenizer(_bpe(tmp_path, 300))
    ids = tok.encode(text)
    pieces, out = stream_all(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_an_artifact_carries_its_tokenizer_json(tmp_path):
    path = _bpe(tmp_path, demo.LM_VOCAB)
    art = pxrt.export_decoder(
        demo.lm_prefill,
        demo.lm_decode,
        demo.make_lm_params(dim=32, heads=2, layers=1),
        tmp_path / "lm",
        cache=demo.lm_cache_spec(1, 2, 32),
        max_length=32,
        prefill_lengths=(16,),
        prefill_batches=(1,),
        tokenizer=path,
    )
    manifest = json.loads((tmp_path / "lm" / "manifest.json").read_text())
    assert manifest["decoder"]["tokenizer"] == {"kind": "tokenizers"}
    assert "tokenizer.json" in manifest["files"]
    dec = pxrt.load(art)
    try:
        assert isinstance(dec.tokenizer, TokenizersTokenizer)
        assert dec.tokenizer.encode("hello") == TokenizersTokenizer(path).encode("hello")
    finally:
        dec.close()
    # Its bytes are checked like every file's.
    (tmp_path / "lm" / "tokenizer.json").write_text("{}")
    with pytest.raises(pxrt.ArtifactError, match="tokenizer.json does not match its sha256"):
        pxrt.load(art)


def test_a_tokenizer_is_checked_against_the_models_vocabulary(tmp_path):
    """A tokenizer with more tokens than the model's logits is refused at export (a text
    prompt could give ids the model has no embedding for); start ids must be inside the
    vocabulary and need a tokenizer. Start ids go before text prompts only, once."""
    common = dict(
        cache=demo.lm_cache_spec(1, 2, 32), max_length=32, prefill_lengths=(16,),
        prefill_batches=(1,),
    )  # fmt: skip
    params = demo.make_lm_params(dim=32, heads=2, layers=1)
    fns = (demo.lm_prefill, demo.lm_decode, params)
    big = _bpe(tmp_path, demo.LM_VOCAB + 40)
    assert TokenizersTokenizer(big).vocab_size > demo.LM_VOCAB
    with pytest.raises(ValueError, match=r"has \d+ tokens, more than the model's vocabulary"):
        pxrt.export_decoder(*fns, tmp_path / "a", tokenizer=big, **common)
    with pytest.raises(ValueError, match="start_ids go before text prompts: they need a tokenizer"):
        pxrt.export_decoder(*fns, tmp_path / "b", start_ids=[1], **common)
    with pytest.raises(ValueError, match=r"start_ids \[999\] are outside the model's vocabulary"):
        pxrt.export_decoder(*fns, tmp_path / "c", tokenizer="bytes", start_ids=[999], **common)
    art = pxrt.export_decoder(
        *fns, tmp_path / "d", tokenizer="bytes", start_ids=[demo.LM_BOS], **common
    )
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["decoder"]["tokenizer"] == {"kind": "bytes", "start_ids": [demo.LM_BOS]}
    with pxrt.load(art) as dec:
        assert dec.tokenizer.encode("hi") == [demo.LM_BOS, 104, 105]
        assert dec.generate("hi", max_tokens=3).prompt_tokens == 3
        assert dec.generate([104, 105], max_tokens=3).prompt_tokens == 2  # ids as given


def _sentencepiece(tmp_path) -> str:
    """A tiny SentencePiece model trained here (what Gemma and Llama 2 ship)."""
    spm = pytest.importorskip("sentencepiece")
    lines = ["pxrt serves JAX programs", "hello world, héllo wörld", "tokens in, text out"] * 20
    path = str(tmp_path / "sp.model")
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=f, vocab_size=290,
            character_coverage=1.0, byte_fallback=True, minloglevel=2,
        )  # fmt: skip
    return path


def test_an_artifact_carries_a_sentencepiece_model(tmp_path):
    from pxrt.tokenizer import SentencePieceTokenizer

    path = _sentencepiece(tmp_path)
    art = pxrt.export_decoder(
        demo.lm_prefill, demo.lm_decode, demo.make_lm_params(vocab=290, dim=32, heads=2, layers=1),
        tmp_path / "lm", cache=demo.lm_cache_spec(1, 2, 32), max_length=32,
        prefill_lengths=(16,), prefill_batches=(1,), tokenizer=path,
    )  # fmt: skip
    manifest = json.loads((tmp_path / "lm" / "manifest.json").read_text())
    assert manifest["decoder"]["tokenizer"] == {"kind": "sentencepiece"}
    assert "tokenizer.model" in manifest["files"]
    text = "hello wörld, ✓ pxrt"  # ✓ is not in its vocabulary: byte fallback pieces
    with pxrt.load(art) as dec:
        assert isinstance(dec.tokenizer, SentencePieceTokenizer)
        ids = dec.tokenizer.encode(text)
        assert ids == SentencePieceTokenizer(path).encode(text)
        pieces, out = stream_all(dec.tokenizer, ids)
        assert "".join(pieces) == dec.tokenizer.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)
        pieces, out = stream_all(dec.tokenizer, ids, stop=["pxrt"])
        assert "".join(pieces) == "hello wörld, ✓ " and out.stopped
    (tmp_path / "lm" / "tokenizer.model").write_bytes(b"x")
    with pytest.raises(pxrt.ArtifactError, match="tokenizer.model does not match its sha256"):
        pxrt.load(art)


def test_chat_templates_are_checked_at_export(tmp_path):
    common = dict(
        cache=demo.lm_cache_spec(1, 2, 32),
        max_length=32,
        prefill_lengths=(16,),
        prefill_batches=(1,),
    )
    params = demo.make_lm_params(dim=32, heads=2, layers=1)
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        pxrt.export_decoder(
            demo.lm_prefill, demo.lm_decode, params, tmp_path / "a",
            tokenizer="bytes", chat_template="{% for %}", **common,
        )  # fmt: skip
    with pytest.raises(ValueError, match="needs a tokenizer"):
        pxrt.export_decoder(
            demo.lm_prefill, demo.lm_decode, params, tmp_path / "b",
            chat_template=demo.LM_CHAT_TEMPLATE, **common,
        )  # fmt: skip


def test_chat_templates_render_in_a_sandbox():
    from jinja2.exceptions import SecurityError

    from pxrt.tokenizer import render_chat

    with pytest.raises(SecurityError):
        render_chat("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", [])
