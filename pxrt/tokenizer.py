"""Tokenizers for decoders: text <-> token ids, and text from a stream of tokens.

A decoder artifact may carry a tokenizer (``export_decoder(..., tokenizer=...)``):

- ``"bytes"``: built in. Token ``i < 256`` is byte ``i``; ids from 256 up are special
  (the demo's BOS and EOS) and decode to nothing.
- a ``tokenizer.json`` for the ``tokenizers`` library (the optional ``tokenizers``
  extra), copied into the artifact and hashed with the rest.

``TextStream`` turns tokens into text as they come without ever emitting half a UTF-8
character, and ends the text at a stop string (the stop string itself is not emitted;
text that could still be the start of one is held back until it cannot).
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Sequence
from typing import Any, Protocol

BYTES = "bytes"
TOKENIZERS = "tokenizers"
TOKENIZER_FILE = "tokenizer.json"


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

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self._tok.decode(list(tokens), skip_special_tokens=True))

    def stream(self) -> _PrefixStream:
        return _PrefixStream(self)


class _PrefixStream:
    """Incremental detokenization for tokenizers whose pieces depend on their neighbours
    (byte-level BPE, SentencePiece spaces): decode a short window of recent tokens, emit
    what it adds to the text already emitted, and hold it back while it ends in the
    replacement character (half a UTF-8 character)."""

    def __init__(self, tokenizer: TokenizersTokenizer) -> None:
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


class TextStream:
    """The text of a generation as its tokens come, cut at the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._decode = tokenizer.stream()
        self._stops = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
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
        if self._stops:
            cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped = True
                self._pending = ""
                self.text += text[:cut]
                return text[:cut]
        keep = 0 if final or not self._stops else min(self._hold, len(text))
        # Hold back only a tail that could still start a stop string.
        while keep and not any(s.startswith(text[len(text) - keep :]) for s in self._stops):
            keep -= 1
        out, self._pending = text[: len(text) - keep], text[len(text) - keep :]
        self.text += out
        return out


def load(config: dict | None, directory: str) -> Any:
    """The tokenizer a decoder artifact's manifest names (None: it carries none)."""
    if not config:
        return None
    if config.get("kind") == BYTES:
        return ByteTokenizer()
    if config.get("kind") == TOKENIZERS:
        return TokenizersTokenizer(os.path.join(directory, TOKENIZER_FILE))
    raise ValueError(f"unknown tokenizer kind {config.get('kind')!r}")


def render_chat(template: str, messages: list, **extra: Any) -> str:
    """A chat template (Jinja, as Hugging Face's ``chat_template``) rendered for
    ``messages`` with ``add_generation_prompt`` true, in a sandbox: a template cannot
    reach Python objects beyond what it is given."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **extra)
