"""HPACK (RFC 7541): the static table, the Huffman code, and what both decoders share.

The decoders are ``serving.grpc._hpack`` (Cython) and its pure-Python twin
``serving.grpc._hpack_py`` (``PXRT_NO_EXTENSIONS=1``); ``serving.grpc.h2`` takes whichever
``pxrt._ext.twin`` chooses.
Tests hold both to the ``hpack`` package's encoder and to RFC 7541's examples.

The Huffman code is decoded four bits at a time by a state machine over the code's tree
(the approach of nghttp2's decoder): a state is an internal node of the tree, and
``HUFFMAN_STEPS[state * 16 + nibble]`` says where four more bits lead, which symbol they
complete (at most one: every code is at least five bits long) and whether they complete
EOS, which a string must not contain. A string may end only in a state on the all-ones
path no deeper than seven bits (its padding is the start of EOS: RFC 7541 5.2).
"""

from __future__ import annotations


class HpackError(ValueError):
    """A header block that does not decode: a COMPRESSION_ERROR of the connection."""


# (name, value), indexed from 1.
STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = (
    (b":authority", b""),  # 1
    (b":method", b"GET"),  # 2
    (b":method", b"POST"),  # 3
    (b":path", b"/"),  # 4
    (b":path", b"/index.html"),  # 5
    (b":scheme", b"http"),  # 6
    (b":scheme", b"https"),  # 7
    (b":status", b"200"),  # 8
    (b":status", b"204"),  # 9
    (b":status", b"206"),  # 10
    (b":status", b"304"),  # 11
    (b":status", b"400"),  # 12
    (b":status", b"404"),  # 13
    (b":status", b"500"),  # 14
    (b"accept-charset", b""),  # 15
    (b"accept-encoding", b"gzip, deflate"),  # 16
    (b"accept-language", b""),  # 17
    (b"accept-ranges", b""),  # 18
    (b"accept", b""),  # 19
    (b"access-control-allow-origin", b""),  # 20
    (b"age", b""),  # 21
    (b"allow", b""),  # 22
    (b"authorization", b""),  # 23
    (b"cache-control", b""),  # 24
    (b"content-disposition", b""),  # 25
    (b"content-encoding", b""),  # 26
    (b"content-language", b""),  # 27
    (b"content-length", b""),  # 28
    (b"content-location", b""),  # 29
    (b"content-range", b""),  # 30
    (b"content-type", b""),  # 31
    (b"cookie", b""),  # 32
    (b"date", b""),  # 33
    (b"etag", b""),  # 34
    (b"expect", b""),  # 35
    (b"expires", b""),  # 36
    (b"from", b""),  # 37
    (b"host", b""),  # 38
    (b"if-match", b""),  # 39
    (b"if-modified-since", b""),  # 40
    (b"if-none-match", b""),  # 41
    (b"if-range", b""),  # 42
    (b"if-unmodified-since", b""),  # 43
    (b"last-modified", b""),  # 44
    (b"link", b""),  # 45
    (b"location", b""),  # 46
    (b"max-forwards", b""),  # 47
    (b"proxy-authenticate", b""),  # 48
    (b"proxy-authorization", b""),  # 49
    (b"range", b""),  # 50
    (b"referer", b""),  # 51
    (b"refresh", b""),  # 52
    (b"retry-after", b""),  # 53
    (b"server", b""),  # 54
    (b"set-cookie", b""),  # 55
    (b"strict-transport-security", b""),  # 56
    (b"transfer-encoding", b""),  # 57
    (b"user-agent", b""),  # 58
    (b"vary", b""),  # 59
    (b"via", b""),  # 60
    (b"www-authenticate", b""),  # 61
)

ENTRY_OVERHEAD = 32  # what an entry costs in a table's size beyond its name and value

# The code of each symbol (0-255, and 256: EOS) as (bits, length).
HUFFMAN_CODE: tuple[tuple[int, int], ...] = (
    (0x1FF8, 13),
    (0x7FFFD8, 23),
    (0xFFFFFE2, 28),
    (0xFFFFFE3, 28),
    (0xFFFFFE4, 28),
    (0xFFFFFE5, 28),
    (0xFFFFFE6, 28),
    (0xFFFFFE7, 28),
    (0xFFFFFE8, 28),
    (0xFFFFEA, 24),
    (0x3FFFFFFC, 30),
    (0xFFFFFE9, 28),
    (0xFFFFFEA, 28),
    (0x3FFFFFFD, 30),
    (0xFFFFFEB, 28),
    (0xFFFFFEC, 28),
    (0xFFFFFED, 28),
    (0xFFFFFEE, 28),
    (0xFFFFFEF, 28),
    (0xFFFFFF0, 28),
    (0xFFFFFF1, 28),
    (0xFFFFFF2, 28),
    (0x3FFFFFFE, 30),
    (0xFFFFFF3, 28),
    (0xFFFFFF4, 28),
    (0xFFFFFF5, 28),
    (0xFFFFFF6, 28),
    (0xFFFFFF7, 28),
    (0xFFFFFF8, 28),
    (0xFFFFFF9, 28),
    (0xFFFFFFA, 28),
    (0xFFFFFFB, 28),
    (0x14, 6),
    (0x3F8, 10),
    (0x3F9, 10),
    (0xFFA, 12),
    (0x1FF9, 13),
    (0x15, 6),
    (0xF8, 8),
    (0x7FA, 11),
    (0x3FA, 10),
    (0x3FB, 10),
    (0xF9, 8),
    (0x7FB, 11),
    (0xFA, 8),
    (0x16, 6),
    (0x17, 6),
    (0x18, 6),
    (0x0, 5),
    (0x1, 5),
    (0x2, 5),
    (0x19, 6),
    (0x1A, 6),
    (0x1B, 6),
    (0x1C, 6),
    (0x1D, 6),
    (0x1E, 6),
    (0x1F, 6),
    (0x5C, 7),
    (0xFB, 8),
    (0x7FFC, 15),
    (0x20, 6),
    (0xFFB, 12),
    (0x3FC, 10),
    (0x1FFA, 13),
    (0x21, 6),
    (0x5D, 7),
    (0x5E, 7),
    (0x5F, 7),
    (0x60, 7),
    (0x61, 7),
    (0x62, 7),
    (0x63, 7),
    (0x64, 7),
    (0x65, 7),
    (0x66, 7),
    (0x67, 7),
    (0x68, 7),
    (0x69, 7),
    (0x6A, 7),
    (0x6B, 7),
    (0x6C, 7),
    (0x6D, 7),
    (0x6E, 7),
    (0x6F, 7),
    (0x70, 7),
    (0x71, 7),
    (0x72, 7),
    (0xFC, 8),
    (0x73, 7),
    (0xFD, 8),
    (0x1FFB, 13),
    (0x7FFF0, 19),
    (0x1FFC, 13),
    (0x3FFC, 14),
    (0x22, 6),
    (0x7FFD, 15),
    (0x3, 5),
    (0x23, 6),
    (0x4, 5),
    (0x24, 6),
    (0x5, 5),
    (0x25, 6),
    (0x26, 6),
    (0x27, 6),
    (0x6, 5),
    (0x74, 7),
    (0x75, 7),
    (0x28, 6),
    (0x29, 6),
    (0x2A, 6),
    (0x7, 5),
    (0x2B, 6),
    (0x76, 7),
    (0x2C, 6),
    (0x8, 5),
    (0x9, 5),
    (0x2D, 6),
    (0x77, 7),
    (0x78, 7),
    (0x79, 7),
    (0x7A, 7),
    (0x7B, 7),
    (0x7FFE, 15),
    (0x7FC, 11),
    (0x3FFD, 14),
    (0x1FFD, 13),
    (0xFFFFFFC, 28),
    (0xFFFE6, 20),
    (0x3FFFD2, 22),
    (0xFFFE7, 20),
    (0xFFFE8, 20),
    (0x3FFFD3, 22),
    (0x3FFFD4, 22),
    (0x3FFFD5, 22),
    (0x7FFFD9, 23),
    (0x3FFFD6, 22),
    (0x7FFFDA, 23),
    (0x7FFFDB, 23),
    (0x7FFFDC, 23),
    (0x7FFFDD, 23),
    (0x7FFFDE, 23),
    (0xFFFFEB, 24),
    (0x7FFFDF, 23),
    (0xFFFFEC, 24),
    (0xFFFFED, 24),
    (0x3FFFD7, 22),
    (0x7FFFE0, 23),
    (0xFFFFEE, 24),
    (0x7FFFE1, 23),
    (0x7FFFE2, 23),
    (0x7FFFE3, 23),
    (0x7FFFE4, 23),
    (0x1FFFDC, 21),
    (0x3FFFD8, 22),
    (0x7FFFE5, 23),
    (0x3FFFD9, 22),
    (0x7FFFE6, 23),
    (0x7FFFE7, 23),
    (0xFFFFEF, 24),
    (0x3FFFDA, 22),
    (0x1FFFDD, 21),
    (0xFFFE9, 20),
    (0x3FFFDB, 22),
    (0x3FFFDC, 22),
    (0x7FFFE8, 23),
    (0x7FFFE9, 23),
    (0x1FFFDE, 21),
    (0x7FFFEA, 23),
    (0x3FFFDD, 22),
    (0x3FFFDE, 22),
    (0xFFFFF0, 24),
    (0x1FFFDF, 21),
    (0x3FFFDF, 22),
    (0x7FFFEB, 23),
    (0x7FFFEC, 23),
    (0x1FFFE0, 21),
    (0x1FFFE1, 21),
    (0x3FFFE0, 22),
    (0x1FFFE2, 21),
    (0x7FFFED, 23),
    (0x3FFFE1, 22),
    (0x7FFFEE, 23),
    (0x7FFFEF, 23),
    (0xFFFEA, 20),
    (0x3FFFE2, 22),
    (0x3FFFE3, 22),
    (0x3FFFE4, 22),
    (0x7FFFF0, 23),
    (0x3FFFE5, 22),
    (0x3FFFE6, 22),
    (0x7FFFF1, 23),
    (0x3FFFFE0, 26),
    (0x3FFFFE1, 26),
    (0xFFFEB, 20),
    (0x7FFF1, 19),
    (0x3FFFE7, 22),
    (0x7FFFF2, 23),
    (0x3FFFE8, 22),
    (0x1FFFFEC, 25),
    (0x3FFFFE2, 26),
    (0x3FFFFE3, 26),
    (0x3FFFFE4, 26),
    (0x7FFFFDE, 27),
    (0x7FFFFDF, 27),
    (0x3FFFFE5, 26),
    (0xFFFFF1, 24),
    (0x1FFFFED, 25),
    (0x7FFF2, 19),
    (0x1FFFE3, 21),
    (0x3FFFFE6, 26),
    (0x7FFFFE0, 27),
    (0x7FFFFE1, 27),
    (0x3FFFFE7, 26),
    (0x7FFFFE2, 27),
    (0xFFFFF2, 24),
    (0x1FFFE4, 21),
    (0x1FFFE5, 21),
    (0x3FFFFE8, 26),
    (0x3FFFFE9, 26),
    (0xFFFFFFD, 28),
    (0x7FFFFE3, 27),
    (0x7FFFFE4, 27),
    (0x7FFFFE5, 27),
    (0xFFFEC, 20),
    (0xFFFFF3, 24),
    (0xFFFED, 20),
    (0x1FFFE6, 21),
    (0x3FFFE9, 22),
    (0x1FFFE7, 21),
    (0x1FFFE8, 21),
    (0x7FFFF3, 23),
    (0x3FFFEA, 22),
    (0x3FFFEB, 22),
    (0x1FFFFEE, 25),
    (0x1FFFFEF, 25),
    (0xFFFFF4, 24),
    (0xFFFFF5, 24),
    (0x3FFFFEA, 26),
    (0x7FFFF4, 23),
    (0x3FFFFEB, 26),
    (0x7FFFFE6, 27),
    (0x3FFFFEC, 26),
    (0x3FFFFED, 26),
    (0x7FFFFE7, 27),
    (0x7FFFFE8, 27),
    (0x7FFFFE9, 27),
    (0x7FFFFEA, 27),
    (0x7FFFFEB, 27),
    (0xFFFFFFE, 28),
    (0x7FFFFEC, 27),
    (0x7FFFFED, 27),
    (0x7FFFFEE, 27),
    (0x7FFFFEF, 27),
    (0x7FFFFF0, 27),
    (0x3FFFFEE, 26),
    (0x3FFFFFFF, 30),
)

EOS = 256
FAIL = 1 << 9  # in a step: these bits complete EOS (or lead nowhere): the string is bad
NO_SYMBOL = 1 << 8  # in a step: these bits complete no symbol


def _steps() -> tuple[list[int], list[bool]]:
    """``(steps, accepting)``: for each state and nibble, ``next_state << 10 | flags |
    symbol`` (``NO_SYMBOL`` instead of a symbol when none is completed, ``FAIL`` when
    the bits are not valid); for each state, whether a string may end there."""
    children: list[list[int]] = [[0, 0]]  # node -> child per bit: > 0 a node, < 0 a leaf
    for symbol, (code, length) in enumerate(HUFFMAN_CODE):
        node = 0
        for i in range(length - 1, -1, -1):
            bit = (code >> i) & 1
            if i == 0:
                children[node][bit] = -(symbol + 1)
            else:
                if children[node][bit] == 0:
                    children.append([0, 0])
                    children[node][bit] = len(children) - 1
                node = children[node][bit]
    accepting = [False] * len(children)
    node = 0
    for _ in range(8):  # the root and the all-ones path down to seven bits
        accepting[node] = True
        node = children[node][1]
    steps = []
    for state in range(len(children)):
        for nibble in range(16):
            node, symbol, flags = state, 0, NO_SYMBOL
            for i in (3, 2, 1, 0):
                child = children[node][(nibble >> i) & 1]
                if child > 0:
                    node = child
                    continue
                symbol = -child - 1
                if symbol == EOS:
                    flags = FAIL
                    break
                flags, node = 0, 0
            steps.append(node << 10 | flags | (symbol if flags == 0 else 0))
    return steps, accepting


HUFFMAN_STEPS, HUFFMAN_ACCEPTING = _steps()
assert len(HUFFMAN_ACCEPTING) == 256  # a full code over 257 symbols has 256 inner nodes
