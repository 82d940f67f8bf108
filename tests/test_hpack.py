"""HPACK decoding (serving.grpc._hpack and its pure-Python twin) against RFC 7541's own
examples and, for random header lists and encoder settings, against the ``hpack``
package's encoder and decoder; malformed blocks are errors in both twins alike."""

from __future__ import annotations

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.grpc import _hpack_py
from serving.grpc.hpack_tables import HpackError

try:
    from serving.grpc import _hpack
except ImportError:  # pragma: no cover - only when the extensions are not built
    _hpack = None

_BUILT = pytest.mark.skipif(_hpack is None, reason="Cython extensions not built")
TWINS = [pytest.param(_hpack, id="cython", marks=_BUILT), pytest.param(_hpack_py, id="python")]


def _hex(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", ""))


# RFC 7541 C.3 (no Huffman coding) and C.4 (Huffman): three requests on one connection,
# the table after each (newest first) and its size.
REQUESTS = [
    ([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"),
      (b":authority", b"www.example.com")],
     [(b":authority", b"www.example.com")], 57),
    ([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"),
      (b":authority", b"www.example.com"), (b"cache-control", b"no-cache")],
     [(b"cache-control", b"no-cache"), (b":authority", b"www.example.com")], 110),
    ([(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/index.html"),
      (b":authority", b"www.example.com"), (b"custom-key", b"custom-value")],
     [(b"custom-key", b"custom-value"), (b"cache-control", b"no-cache"),
      (b":authority", b"www.example.com")], 164),
]  # fmt: skip
C3 = ["8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d", "8286 84be 5808 6e6f 2d63 6163 6865",
      "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65"]  # fmt: skip
C4 = ["8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff", "8286 84be 5886 a8eb 1064 9cbf",
      "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf"]  # fmt: skip

# RFC 7541 C.6: three responses, Huffman-coded, with a 256-byte table (entries evicted).
C6 = [
    "4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6 2d1b "
    "ff6e 919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3",
    "4883 640e ffc1 c0bf",
    "88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab 77ad "
    "94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f 9587 3160 "
    "65c0 03ed 4ee5 b106 3d50 07",
]
DATE1, DATE2 = b"Mon, 21 Oct 2013 20:13:21 GMT", b"Mon, 21 Oct 2013 20:13:22 GMT"
LOCATION = (b"location", b"https://www.example.com")
COOKIE = b"foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"
RESPONSES = [
    ([(b":status", b"302"), (b"cache-control", b"private"), (b"date", DATE1), LOCATION], 222),
    ([(b":status", b"307"), (b"cache-control", b"private"), (b"date", DATE1), LOCATION], 222),
    ([(b":status", b"200"), (b"cache-control", b"private"), (b"date", DATE2), LOCATION,
      (b"content-encoding", b"gzip"), (b"set-cookie", COOKIE)], 215),
]  # fmt: skip


@pytest.mark.parametrize("impl", TWINS)
@pytest.mark.parametrize("blocks", [C3, C4], ids=["plain", "huffman"])
def test_rfc7541_requests(impl, blocks):
    decoder = impl.Decoder()
    for block, (headers, table, size) in zip(blocks, REQUESTS):
        assert decoder.decode(_hex(block)) == headers
        assert decoder.entries[::-1] == table and decoder.size == size


@pytest.mark.parametrize("impl", TWINS)
def test_rfc7541_responses_with_eviction(impl):
    decoder = impl.Decoder(max_table_size=256)
    for block, (headers, size) in zip(C6, RESPONSES):
        assert decoder.decode(_hex(block)) == headers
        assert decoder.size == size
    assert decoder.entries[-1] == (b"set-cookie", COOKIE)


@pytest.mark.parametrize("impl", TWINS)
def test_an_indexed_header_is_the_table_entry_itself(impl):
    # Clients send repeated headers as indexes: decoding them allocates nothing new.
    decoder = impl.Decoder()
    decoder.decode(_hex(C3[0]))
    again = decoder.decode(_hex("8286 84be"))
    assert again[3] is decoder.entries[-1]


names = st.one_of(
    st.sampled_from([b":path", b":authority", b"content-type", b"grpc-timeout", b"te"]),
    st.binary(min_size=1, max_size=12),
)
fields = st.tuples(names, st.binary(max_size=40), st.sampled_from(["index", "plain", "never"]))


@settings(max_examples=300, deadline=None)
@given(
    blocks=st.lists(
        st.tuples(
            st.lists(fields, max_size=10),
            st.booleans(),  # Huffman
            st.one_of(st.none(), st.sampled_from([0, 64, 256, 4096])),  # table size change
        ),
        min_size=1,
        max_size=6,
    )
)
def test_twins_agree_with_the_hpack_package(blocks):
    encoder = hpack.Encoder()
    reference = hpack.Decoder()
    decoders = [impl.Decoder() for impl in (_hpack, _hpack_py) if impl is not None]
    for headers, huffman, table_size in blocks:
        if table_size is not None:
            encoder.header_table_size = table_size
        listed = [
            hpack.NeverIndexedHeaderTuple(n, v) if how == "never" else (n, v)
            for n, v, how in headers
        ]
        block = encoder.encode(listed, huffman=huffman)
        want = [(bytes(n), bytes(v)) for n, v in reference.decode(block, raw=True)]
        for decoder in decoders:
            assert decoder.decode(block) == want
    assert all(d.entries == decoders[0].entries for d in decoders)
    assert all(d.size == decoders[0].size for d in decoders)


MALFORMED = {
    "index 0": "80",
    "index past the table": "be",
    "an integer that never ends": "ff ff ff",
    "an integer too large": "ff ff ff ff ff ff 7f",
    "a string past the block": "40 05 61 62",
    "a block that ends before the value": "40 01 61",
    "a size update over the maximum": "3f e2 1f",  # 4097
    "a size update after a field": "82 20",
    "EOS inside a Huffman string": "40 81 61 84 ff ff ff ff",
    "Huffman padding of zeros": "40 81 61 81 00",
    "Huffman padding longer than 7 bits": "40 81 61 82 1f ff",
}


@pytest.mark.parametrize("impl", TWINS)
@pytest.mark.parametrize("block", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_blocks_are_hpack_errors(impl, block):
    with pytest.raises(HpackError):
        impl.Decoder().decode(_hex(block))


@pytest.mark.parametrize("impl", TWINS)
def test_a_small_block_cannot_expand_past_the_list_limit(impl):
    # One 4 KB entry named 100 times is 400 KB from ~100 bytes: stopped at the limit.
    decoder = impl.Decoder(max_list_size=16384)
    value = b"v" * 4000
    block = bytes([0x40, 1, ord("k")]) + bytes(
        [0x7F, 0x80 + (4000 - 127) % 128, (4000 - 127) // 128]
    )
    block += value + bytes([0xBE]) * 100
    with pytest.raises(HpackError, match="over 16384"):
        decoder.decode(block)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_decode_alike_or_fail_alike(block):
    answers = []
    for impl in (_hpack, _hpack_py):
        if impl is None:
            continue
        try:
            answers.append(("ok", impl.Decoder().decode(block)))
        except HpackError as exc:
            answers.append(("error", str(exc)))
    assert all(a == answers[0] for a in answers)
