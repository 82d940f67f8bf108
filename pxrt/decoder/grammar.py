"""Structured outputs: generated text held to a JSON schema, a regular expression, a
list of choices or a grammar, by masking on the device every token the grammar does
not allow next.

``StructuredOutput`` is the request's constraint (vLLM's ``structured_outputs`` fields:
``json``, ``json_object``, ``regex``, ``choice``, ``grammar``); it is compiled and
checked where it is made, so a schema the engine cannot take is refused by name in the
front end. ``Grammars`` is a decoder's side: the grammar engine's view of its tokenizer
(every token's bytes), a matcher per request, and the allowed-token masks of a step.

The engine is llguidance (Microsoft's guidance, in Rust; vLLM and SGLang use it): a
wheel with no Python dependencies, where xgrammar pulls in torch and triton. A mask
is one bit per token, 32 tokens to an int32 word, as ``pxrt.sampling`` reads it.
Pure Python (no jax): a front end imports it.
"""

from __future__ import annotations

import functools
import json as _json
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

#: How generated JSON is laid out: no free whitespace (a model that may put any amount
#: of it between two tokens can emit it forever), with the separators Python's
#: ``json.dumps`` writes.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

#: The constraint kinds, in the order a request is checked.
KINDS = ("json", "json_object", "regex", "choice", "grammar")

INSTALL = "structured outputs need the llguidance package: pip install 'pxrt[structured]'"


def _engine() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # (an optional extra)
        raise ValueError(INSTALL) from exc
    return llguidance


def words(vocab: int) -> int:
    """Int32 words of a ``vocab``-token mask."""
    return (vocab + 31) // 32


class StructuredOutput(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """One constraint on a generation's text; exactly one field is given.

    - ``json``: a JSON schema (a dict, or its text); the text is JSON that validates.
    - ``json_object`` true: any JSON object (OpenAI's JSON mode).
    - ``regex``: the whole text matches it (Rust's regex syntax).
    - ``choice``: the text is one of these strings.
    - ``grammar``: a Lark grammar (llguidance's), or GBNF as llama.cpp writes it.

    Checked and compiled when made: a ValueError naming the field and the engine's
    reason. JSON is written without free whitespace (``JSON_LAYOUT``).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured output: give exactly one of " + ", ".join(KINDS)
                + (f" (got {', '.join(given)})" if given else "")
            )  # fmt: skip
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = _json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured output: json: not JSON ({exc})") from None
            if not isinstance(value, dict):
                raise ValueError(
                    f"structured output: json must be a JSON schema (an object), "
                    f"got {type(value).__name__}"
                )
            msgspec.structs.force_setattr(self, "json", value)
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"structured output: json_object must be true, got {value!r:.40}")
        elif kind == "choice":
            if not (
                isinstance(value, (list, tuple))
                and value
                and all(isinstance(c, str) and c for c in value)
            ):
                raise ValueError(
                    "structured output: choice must be a non-empty list of non-empty "
                    f"strings, got {value!r:.60}"
                )
            msgspec.structs.force_setattr(self, "choice", tuple(value))
        elif not isinstance(value, str) or not value:
            raise ValueError(f"structured output: {kind} must be a non-empty string")
        self.compiled()  # (checked: refused here, not in the decoder's process)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def compiled(self) -> str:
        """The engine's grammar for it (cached by content); a ValueError naming the
        kind and the engine's reason when it cannot take it."""
        kind = self.kind
        value = getattr(self, kind)
        text = _json.dumps(value, sort_keys=True) if kind in ("json", "choice") else str(value)
        return _compile(kind, text)


@functools.lru_cache(maxsize=256)
def _compile(kind: str, text: str) -> str:
    llg = _engine()
    matcher = llg.LLMatcher
    try:
        if kind == "json":
            grammar = matcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
        elif kind == "json_object":
            grammar = matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(text)
        elif kind == "choice":
            grammar = llg.grammar_from("choice", text)
        else:
            grammar = llg.grammar_from("grammar", text)
    except ValueError as exc:
        raise ValueError(f"structured output: {kind}: {exc}") from None
    failed, messages = matcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise ValueError(f"structured output: {kind}: {_first_line(messages[0])}")
    return str(grammar)


def _first_line(message: str) -> str:
    """The engine's message on one line (without its caret lines), at most 400 chars."""
    lines = [line.strip() for line in str(message).splitlines()]
    return " ".join(line for line in lines if line.strip("^ ~"))[:400]


def token_bytes(tokenizer: Any, vocab: int) -> tuple[list[bytes], list[int]]:
    """Every token's bytes (``vocab`` of them) and the special ones' ids, for a
    tokenizer ``pxrt.tokenizer`` loads that has no ``tokenizer.json`` (bytes,
    SentencePiece); ids past the tokenizer's are special (never allowed)."""
    from .. import tokenizer as tk

    inner = getattr(tokenizer, "tokenizer", tokenizer)  # (``StartIds``)
    pieces: list[bytes] = []
    special: list[int] = []
    if inner.kind == tk.BYTES:
        pieces = [bytes((i,)) for i in range(min(vocab, 256))]
    elif inner.kind == tk.SENTENCEPIECE:
        sp = inner._sp
        for i in range(min(vocab, sp.get_piece_size())):
            piece = sp.id_to_piece(i)
            if sp.is_byte(i):
                pieces.append(bytes((int(piece[3:5], 16),)))
            elif sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
                pieces.append(f"<special {i}>".encode())
                special.append(i)
            else:
                pieces.append(piece.replace("\u2581", " ").encode("utf-8"))
    else:
        raise ValueError(f"structured outputs: tokenizer kind {inner.kind!r} is not known")
    for i in range(len(pieces), vocab):
        pieces.append(f"<special {i}>".encode())
        special.append(i)
    return pieces, special


def _padded(text: str, size: int, vocab: int) -> str:
    """A ``tokenizer.json`` of ``size`` tokens with the model's ids past them (up to
    ``vocab``: its end token may be one) added as special tokens, never allowed."""
    if size >= vocab:
        return text
    doc = _json.loads(text)
    added = doc.setdefault("added_tokens", [])
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    for i in range(size, vocab):
        added.append({"id": i, "content": f"<|pxrt special {i}|>", **flags, "special": True})
    return _json.dumps(doc)


class _Wrapped:
    """A tokenizer as llguidance's ``TokenizerWrapper`` reads one."""

    def __init__(self, tokenizer: Any, pieces: list[bytes], special: list[int], eos: int) -> None:
        self._tokenizer = tokenizer
        self.tokens = pieces
        self.special_token_ids = special
        self.eos_token_id = eos
        self.bos_token_id = None

    def __call__(self, text: str) -> list[int]:
        inner = getattr(self._tokenizer, "tokenizer", self._tokenizer)
        return list(inner.encode(text))


class Grammars:
    """A decoder's grammar engine: its tokenizer as the engine sees it (``vocab``
    tokens, the generation ending at any of ``eos_ids``), the matchers of requests,
    and the masks of a step, computed one after the other on the caller's thread:
    llguidance's pool (``LLExecutor``) was measured not to pay for itself here (on a
    2-core CPU device its threads, waking and spinning between steps, slowed XLA's
    programs: the grammar's time per token halved without them; on a 13-core TPU host
    59 against 63 us per token, within the noise)."""

    def __init__(self, tokenizer: Any, vocab: int, eos_ids: Sequence[int], path: str) -> None:
        from .. import tokenizer as tk

        llg = _engine()
        self.vocab = vocab
        self.words = words(vocab)
        eos = sorted(int(t) for t in eos_ids if 0 <= t < vocab)
        if not eos:
            raise ValueError(
                "structured outputs need an end token to stop at once the grammar is "
                "complete, and this decoder has no stop ids (export it with eos_id=)"
            )
        inner = getattr(tokenizer, "tokenizer", tokenizer)
        if inner.kind == tk.TOKENIZERS:
            with open(f"{path}/{tk.TOKENIZER_FILE}", encoding="utf-8") as f:
                text = _padded(f.read(), inner.vocab_size, vocab)
            self.tokenizer = llg.LLTokenizer(text, n_vocab=vocab, eos_token=eos)
        else:
            pieces, special = token_bytes(tokenizer, vocab)
            wrapper = llg.TokenizerWrapper(_Wrapped(tokenizer, pieces, special, eos[0]))
            self.tokenizer = llg.LLTokenizer(wrapper, n_vocab=vocab, eos_token=eos)
        self._llg = llg
        self._lock = threading.Lock()

    def matcher(self, structured: StructuredOutput) -> tuple[Any, np.ndarray]:
        """A fresh matcher for one request, and the mask of its first token ``[1,
        words]`` (a ValueError naming the kind when the grammar does not fit this
        tokenizer). Under the engine's lock, as every call into it: a request's
        thread makes matchers while the loop's computes the steps' masks."""
        with self._lock:
            m = _unpanicked(self._llg.LLMatcher, self.tokenizer, structured.compiled(), log_level=0)
            if m.is_error():
                error = _first_line(m.get_error())
                raise ValueError(f"structured output: {structured.kind}: {error}")
            out = np.zeros((1, self.words), np.int32)
            _unpanicked(m.unsafe_compute_mask_ptr, out.ctypes.data, out.nbytes)
        return m, out

    def consume(self, pairs: list[tuple[Any, int]]) -> None:
        """Each (matcher, token) of ``pairs``: the token taken (a refused
        one leaves its matcher in its error state)."""
        if pairs:  # (a token is a microsecond or two: never worth a pool)
            with self._lock:
                for matcher, token in pairs:
                    _unpanicked(matcher.consume_token, token)

    def take(self, matcher: Any, tokens: list[int]) -> None:
        """``tokens`` into one matcher, in order."""
        with self._lock:
            _unpanicked(matcher.consume_tokens, tokens)

    def masks(self, pairs: list[tuple[Any, int]], slots: int) -> np.ndarray:
        """A step's masks ``[slots, words]``: row ``i`` of each (matcher, i) in ``pairs``
        its allowed tokens, every other row all allowed."""
        out = np.full((slots, self.words), -1, np.int32)
        if pairs:
            base, row = out.ctypes.data, self.words * 4
            with self._lock:
                for matcher, i in pairs:
                    _unpanicked(matcher.unsafe_compute_mask_ptr, base + i * row, row)
        return out


def _unpanicked(call: Any, *args: Any, **kwargs: Any) -> Any:
    """``call``: a panic in the engine (pyo3's PanicException, a BaseException) as a
    RuntimeError, which fails one request or one step, not a thread."""
    try:
        return call(*args, **kwargs)
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise RuntimeError(f"structured output: the grammar engine failed: {exc}") from None


_LOCK = threading.Lock()


def grammars_of(decoder: Any) -> Grammars:
    """``decoder``'s grammar engine, made on first use (once)."""
    got = decoder._grammars
    if got is not None:
        return got
    with _LOCK:
        got = decoder._grammars
        if got is None:
            if decoder.tokenizer is None:
                raise ValueError(
                    f"structured outputs need the decoder's tokenizer and {decoder.name!r} "
                    "carries none (export it with tokenizer=)"
                )
            got = Grammars(
                decoder.tokenizer, decoder.vocab, decoder.stop_ids, decoder.artifact.path
            )
            decoder._grammars = got
        return got
