"""Tokenizers for decoders: text <-> token ids, and text from a stream of tokens.

A decoder artifact may carry a tokenizer (``export_decoder(..., tokenizer=...)``):

- ``"bytes"``: built in. Token ``i < 256`` is byte ``i``; ids from 256 up are special
  (the demo's BOS and EOS) and decode to nothing.
- a ``tokenizer.json`` for the ``tokenizers`` library (the optional ``tokenizers``
  extra), copied into the artifact and hashed with the rest;
- a SentencePiece ``.model`` (Gemma's, Llama 2's, T5's; the optional ``sentencepiece``
  extra), carried the same way as ``tokenizer.model``.

Text is encoded without the tokenizer's own special tokens (the prompt is what the client
sent); a model that expects a start token before a text prompt (keras-hub's
``add_start_token``: GPT-2's ``<|endoftext|>``, Gemma's ``<bos>``) says so with the
artifact's ``start_ids``, put before every text prompt that does not begin with them.

``TextStream`` turns tokens into text as they come without ever emitting half a UTF-8
character, and ends the text at a stop string (the stop string itself is not emitted;
text that could still be the start of one is held back until it cannot).
"""

from __future__ import annotations

import codecs
import collections
import os
from collections.abc import Sequence
from typing import Any, Protocol

BYTES = "bytes"
TOKENIZERS = "tokenizers"
TOKENIZER_FILE = "tokenizer.json"
SENTENCEPIECE = "sentencepiece"
SENTENCEPIECE_FILE = "tokenizer.model"
# kind -> the file an artifact carries it in
FILES = {TOKENIZERS: TOKENIZER_FILE, SENTENCEPIECE: SENTENCEPIECE_FILE}


class Tokenizer(Protocol):
    """What a decoder's tokenizer offers."""

    def encode(self, text: str) -> list[int]: ...

    def stream(self) -> TokenDecoder: ...


class TokenDecoder(Protocol):
    """Text from tokens, one at a time: ``push`` returns the text that is complete."""

    def push(self, token: int) -> str: ...

    def flush(self) -> str: ...


class ByteTokenizer:
    """Bytes as tokens: 0..255 are bytes, higher ids special (no text)."""

    kind = BYTES

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")

    def stream(self) -> _ByteStream:
        return _ByteStream()


class _ByteStream:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        if 0 <= token < 256:
            return self._utf8.decode(bytes((token,)))
        return ""

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class TokenizersTokenizer:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json``."""

    kind = TOKENIZERS

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError:
            raise RuntimeError(
                f"{path} needs the `tokenizers` package: pip install 'pxrt[tokenizers]'"
            ) from None
        self._tok = _HF.from_file(path)
        self.vocab_size = int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self._tok.decode(list(tokens), skip_special_tokens=True))

    def stream(self) -> _PrefixStream:
        return _PrefixStream(self)


class SentencePieceTokenizer:
    """A SentencePiece model (``.model``). Text is encoded without BOS or EOS (the
    prompt is what the client sent); decoding drops control tokens."""

    kind = SENTENCEPIECE

    def __init__(self, path: str) -> None:
        try:
            import sentencepiece
        except ImportError:
            raise RuntimeError(
                f"{path} needs the `sentencepiece` package: pip install 'pxrt[sentencepiece]'"
            ) from None
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"{path} is not a SentencePiece model: {exc}") from None
        self.vocab_size = int(self._sp.GetPieceSize())

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self._sp.EncodeAsIds(text)]

    def decode(self, tokens: Sequence[int]) -> str:
        size = self._sp.GetPieceSize()
        return str(self._sp.DecodeIds([int(t) for t in tokens if 0 <= t < size]))

    def stream(self) -> _PrefixStream:
        return _PrefixStream(self)


class _Decodes(Protocol):
    def decode(self, tokens: Sequence[int]) -> str: ...


def from_file(path: str) -> TokenizersTokenizer | SentencePieceTokenizer:
    """A tokenizer file as export takes it: a SentencePiece ``.model``, else a
    ``tokenizer.json``."""
    if path.endswith(".model"):
        return SentencePieceTokenizer(path)
    return TokenizersTokenizer(path)


class _PrefixStream:
    """Incremental detokenization for tokenizers whose pieces depend on their neighbours
    (byte-level BPE, SentencePiece spaces): decode a short window of recent tokens, emit
    what it adds to the text already emitted, and hold it back while it ends in the
    replacement character (half a UTF-8 character)."""

    def __init__(self, tokenizer: _Decodes) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # the window starts here
        self._read = 0  # text up to here has been emitted

    def push(self, token: int) -> str:
        self._ids.append(token)
        before = self._tok.decode(self._ids[self._prefix : self._read])
        now = self._tok.decode(self._ids[self._prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        before = self._tok.decode(self._ids[self._prefix : self._read])
        now = self._tok.decode(self._ids[self._prefix :])
        self._read = len(self._ids)
        return now[len(before) :]


class StopMatcher:
    """The stop strings as an Aho-Corasick automaton fed one character at a time: after
    each, the length of the longest stop string that just ended (0: none), and in
    ``held`` the length of the longest end of the text so far that could still begin
    one. Each character costs O(1) (amortized), however many stop strings there are.
    (pyahocorasick finds matches in whole strings; a stream needs the state kept between
    its pieces, which it does not expose.)"""

    def __init__(self, stops: Sequence[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth, ends = [0], [0]
        for stop in stops:
            node = 0
            for c in stop:
                child = goto[node].get(c)
                if child is None:
                    child = goto[node][c] = len(goto)
                    goto.append({})
                    depth.append(depth[node] + 1)
                    ends.append(0)
                node = child
            ends[node] = max(ends[node], len(stop))
        fail = [0] * len(goto)
        queue = collections.deque(goto[0].values())
        while queue:  # breadth first: a node's fail link is shallower than it
            node = queue.popleft()
            for c, child in goto[node].items():
                queue.append(child)
                f = fail[node]
                while f and c not in goto[f]:
                    f = fail[f]
                link = goto[f].get(c, 0) if node else 0
                fail[child] = link
                ends[child] = max(ends[child], ends[link])  # (the longest: it began first)
        self._goto, self._fail, self._depth, self._ends = goto, fail, depth, ends
        self._state = 0

    def feed(self, c: str) -> int:
        node, goto = self._state, self._goto
        while node and c not in goto[node]:
            node = self._fail[node]
        node = self._state = goto[node].get(c, 0)
        return self._ends[node]

    @property
    def held(self) -> int:
        return self._depth[self._state]


class TextStream:
    """The text of a generation as its tokens come, cut at the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._decode = tokenizer.stream()
        stops = [s for s in stop if s]
        self._stops = StopMatcher(stops) if stops else None
        self._pending = ""  # emitted once it cannot be part of a stop string
        self.stopped = False
        self.text = ""  # everything emitted

    def push(self, token: int) -> str:
        """Text to emit after ``token`` ("" while it may be part of a character or of
        a stop string); once a stop string appears, ``stopped`` is set and nothing more
        is emitted."""
        if self.stopped:
            return ""
        return self._emit(self._decode.push(token), final=False)

    def flush(self) -> str:
        """The rest, at the end of the generation."""
        if self.stopped:
            return ""
        return self._emit(self._decode.flush(), final=True)

    def _emit(self, piece: str, final: bool) -> str:
        text = self._pending + piece
        keep = 0
        stops = self._stops
        if stops is not None:
            # Only the new characters are fed: the work per token is its text's.
            at = len(self._pending)
            for i, c in enumerate(piece):
                ended = stops.feed(c)
                if ended:
                    cut = at + i + 1 - ended
                    self.stopped = True
                    self._pending = ""
                    self.text += text[:cut]
                    return text[:cut]
            keep = 0 if final else stops.held
        out, self._pending = text[: len(text) - keep], text[len(text) - keep :]
        self.text += out
        return out


class StartIds:
    """A tokenizer whose text prompts begin with ``start_ids`` (the model's start token),
    unless the text already encodes to them (a chat template that writes its BOS)."""

    def __init__(self, tokenizer: Any, start_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.start_ids = [int(t) for t in start_ids]
        self.kind = tokenizer.kind
        self.vocab_size = tokenizer.vocab_size

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        n = len(self.start_ids)
        return ids if ids[:n] == self.start_ids else [*self.start_ids, *ids]

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(tokens))

    def stream(self) -> Any:
        return self.tokenizer.stream()


def artifact_files(
    tokenizer: str | os.PathLike | None,
    chat_template: str | None = None,
    start_ids: Sequence[int] = (),
) -> tuple[dict[str, bytes], dict | None, int]:
    """The tokenizer's files to write into the artifact, its config and its vocabulary
    size (the chat template checked: it must parse, and needs a tokenizer)."""
    if start_ids and tokenizer is None:
        raise ValueError("start_ids go before text prompts: they need a tokenizer")
    if chat_template is not None:
        if tokenizer is None:
            raise ValueError("a chat_template needs a tokenizer (to turn its text into tokens)")
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:
            ImmutableSandboxedEnvironment().parse(chat_template)
        except TemplateSyntaxError as exc:
            raise ValueError(f"chat_template is not a valid Jinja template: {exc}") from None
    files: dict[str, bytes] = {}
    tok_config: dict | None = None
    size = 0
    if tokenizer is not None:
        if tokenizer == BYTES:
            tok_config, size = {"kind": BYTES}, 256
        else:
            loaded = from_file(os.fspath(tokenizer))  # it must load
            with open(os.fspath(tokenizer), "rb") as f:
                files[FILES[loaded.kind]] = f.read()
            tok_config, size = {"kind": loaded.kind}, loaded.vocab_size
        if start_ids:
            tok_config["start_ids"] = [int(t) for t in start_ids]
    return files, tok_config, size


def load(config: dict | None, directory: str) -> Any:
    """The tokenizer a decoder artifact's manifest names (None: it carries none)."""
    if not config:
        return None
    kind = config.get("kind")
    tokenizer: Any
    if kind == BYTES:
        tokenizer = ByteTokenizer()
    elif kind == TOKENIZERS:
        tokenizer = TokenizersTokenizer(os.path.join(directory, TOKENIZER_FILE))
    elif kind == SENTENCEPIECE:
        tokenizer = SentencePieceTokenizer(os.path.join(directory, SENTENCEPIECE_FILE))
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}")
    start = config.get("start_ids")
    return StartIds(tokenizer, start) if start else tokenizer


def render_chat(template: str, messages: list, **extra: Any) -> str:
    """A chat template (Jinja, as Hugging Face's ``chat_template``) rendered for
    ``messages`` with ``add_generation_prompt`` true, in a sandbox: a template cannot
    reach Python objects beyond what it is given."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **extra)
