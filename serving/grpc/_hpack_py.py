"""HPACK header block decoding (RFC 7541), pure Python: the twin of ``serving.grpc._hpack``.

One ``Decoder`` per HTTP/2 connection holds the dynamic table that the peer's encoder
fills; ``decode(block)`` returns the block's header list as ``(name, value)`` byte-string
pairs. Entries are kept as those tuples, so a header sent as an index into the table
(what clients send for every header they repeat) costs no allocation. Any error is an
``HpackError``: the connection's decoding state is then lost (a COMPRESSION_ERROR).
"""

from __future__ import annotations

from .hpack_tables import (
    ENTRY_OVERHEAD,
    FAIL,
    HUFFMAN_ACCEPTING,
    HUFFMAN_STEPS,
    NO_SYMBOL,
    STATIC_TABLE,
    HpackError,
)

_STATIC = len(STATIC_TABLE)
_INT_LIMIT = 1 << 31  # integers past this are refused (no index or length comes close)


class Decoder:
    """The decoding side of one connection's HPACK context.

    Args:
      max_table_size: the most the peer's dynamic table may hold (what the connection's
        SETTINGS_HEADER_TABLE_SIZE advertised); a size update beyond it is an error.
      max_list_size: the most a decoded header list may hold (names, values and 32
        bytes per field, as RFC 9113's SETTINGS_MAX_HEADER_LIST_SIZE counts): decoding
        stops with an error past it, so a small block cannot expand without bound.
    """

    def __init__(self, max_table_size: int = 4096, max_list_size: int = 65536) -> None:
        self.max_table_size = max_table_size
        self.max_list_size = max_list_size
        self.table_size = max_table_size  # the size the peer's encoder uses now
        self.size = 0  # what the entries hold now
        self.entries: list[tuple[bytes, bytes]] = []  # oldest first

    def decode(self, block: bytes | memoryview) -> list[tuple[bytes, bytes]]:
        """The header list of one complete header block."""
        data = bytes(block)
        end = len(data)
        headers: list[tuple[bytes, bytes]] = []
        listed = 0
        pos = 0
        while pos < end:
            first = data[pos]
            if first & 0x80:  # indexed field
                index, pos = _integer(data, pos, 7)
                field = self._field(index)
            elif first & 0xC0 == 0x40:  # literal, added to the table
                field, pos = self._literal(data, pos, 6)
                self._add(field)
            elif first & 0xE0 == 0x20:  # table size update: only before the first field
                if headers:
                    raise HpackError("a dynamic table size update after a header field")
                size, pos = _integer(data, pos, 5)
                if size > self.max_table_size:
                    raise HpackError(
                        f"a dynamic table size update to {size} is over the {self.max_table_size} "
                        "allowed"
                    )
                self.table_size = size
                self._evict(0)
                continue
            else:  # literal, not added (0000) or never to be added (0001)
                field, pos = self._literal(data, pos, 4)
            listed += len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
            if listed > self.max_list_size:
                raise HpackError(f"the header list is over {self.max_list_size} bytes")
            headers.append(field)
        return headers

    def _field(self, index: int) -> tuple[bytes, bytes]:
        if index == 0:
            raise HpackError("header index 0")
        if index <= _STATIC:
            return STATIC_TABLE[index - 1]
        dynamic = index - _STATIC
        if dynamic > len(self.entries):
            raise HpackError(
                f"header index {index} is past the table ({_STATIC + len(self.entries)})"
            )
        return self.entries[-dynamic]

    def _literal(self, data: bytes, pos: int, prefix: int) -> tuple[tuple[bytes, bytes], int]:
        index, pos = _integer(data, pos, prefix)
        if index:
            name = self._field(index)[0]
        else:
            name, pos = _string(data, pos)
        value, pos = _string(data, pos)
        return (name, value), pos

    def _add(self, field: tuple[bytes, bytes]) -> None:
        size = len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
        if size > self.table_size:  # an entry larger than the table empties it
            self.entries.clear()
            self.size = 0
            return
        self._evict(size)
        self.entries.append(field)
        self.size += size

    def _evict(self, room: int) -> None:
        """Drop the oldest entries until ``room`` more bytes fit."""
        entries = self.entries
        while entries and self.size + room > self.table_size:
            name, value = entries.pop(0)
            self.size -= len(name) + len(value) + ENTRY_OVERHEAD


def _integer(data: bytes, pos: int, prefix: int) -> tuple[int, int]:
    """The integer with a ``prefix``-bit prefix at ``pos``, and the position after it."""
    limit = (1 << prefix) - 1
    value = data[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    end = len(data)
    while True:
        if pos >= end:
            raise HpackError("a header block ends inside an integer")
        byte = data[pos]
        pos += 1
        if shift > 28:
            raise HpackError("an integer in a header block is too large")
        value += (byte & 0x7F) << shift
        if value >= _INT_LIMIT:
            raise HpackError("an integer in a header block is too large")
        if not byte & 0x80:
            return value, pos
        shift += 7


def _string(data: bytes, pos: int) -> tuple[bytes, int]:
    """The string literal at ``pos`` (Huffman-coded or not), and the position after it."""
    if pos >= len(data):
        raise HpackError("a header block ends before a string")
    huffman = data[pos] & 0x80
    length, pos = _integer(data, pos, 7)
    end = pos + length
    if end > len(data):
        raise HpackError("a string runs past the end of its header block")
    if not huffman:
        return data[pos:end], end
    return huffman_decode(data[pos:end]), end


def huffman_decode(data: bytes) -> bytes:
    """A Huffman-coded string (RFC 7541 5.2), four bits at a time."""
    out = bytearray()
    state = 0
    steps = HUFFMAN_STEPS
    for byte in data:
        for nibble in (byte >> 4, byte & 0xF):
            step = steps[state << 4 | nibble]
            if step & FAIL:
                raise HpackError("a Huffman-coded string holds EOS or an invalid code")
            if not step & NO_SYMBOL:
                out.append(step & 0xFF)
            state = step >> 10
    if not HUFFMAN_ACCEPTING[state]:
        raise HpackError("a Huffman-coded string ends with invalid padding")
    return bytes(out)


__all__ = ["Decoder", "HpackError", "huffman_decode"]
