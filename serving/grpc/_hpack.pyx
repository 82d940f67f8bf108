# cython: language_level=3
"""HPACK header block decoding (RFC 7541) in C: ``serving.grpc._hpack_py`` is its pure-Python
twin, with the same API; tests hold both to the ``hpack`` package's encoder.

One ``Decoder`` per HTTP/2 connection holds the dynamic table that the peer's encoder
fills; ``decode(block)`` returns the block's header list as ``(name, value)`` byte-string
pairs. Entries are kept as those tuples, so a header sent as an index into the table
(what clients send for every header they repeat) costs no allocation. Any error is an
``HpackError``: the connection's decoding state is then lost (a COMPRESSION_ERROR).
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport uint16_t, uint32_t

from . import hpack_tables as _tables
from .hpack_tables import HpackError

# The Huffman state machine and the static table as C globals (hpack_tables builds them).
cdef uint32_t _STEPS[4096]
cdef unsigned char _ACCEPTING[256]
cdef uint32_t _FAIL = _tables.FAIL
cdef uint32_t _NO_SYMBOL = _tables.NO_SYMBOL
cdef Py_ssize_t _OVERHEAD = _tables.ENTRY_OVERHEAD
cdef tuple _STATIC = _tables.STATIC_TABLE
cdef Py_ssize_t _NSTATIC = len(_tables.STATIC_TABLE)
cdef unsigned long long _INT_LIMIT = 1ULL << 31

for _i in range(4096):
    _STEPS[_i] = _tables.HUFFMAN_STEPS[_i]
for _i in range(256):
    _ACCEPTING[_i] = _tables.HUFFMAN_ACCEPTING[_i]


cdef inline Py_ssize_t _integer(const unsigned char* data, Py_ssize_t* pos, Py_ssize_t end,
                                int prefix) except -1:
    """The integer with a ``prefix``-bit prefix at ``pos[0]``; ``pos[0]`` moves past it."""
    cdef unsigned long long limit = (1 << prefix) - 1
    cdef unsigned long long value = data[pos[0]] & limit
    cdef unsigned char byte
    cdef int shift = 0
    pos[0] += 1
    if value < limit:
        return <Py_ssize_t>value
    while True:
        if pos[0] >= end:
            raise HpackError("a header block ends inside an integer")
        byte = data[pos[0]]
        pos[0] += 1
        if shift > 28:
            raise HpackError("an integer in a header block is too large")
        value += <unsigned long long>(byte & 0x7F) << shift
        if value >= _INT_LIMIT:
            raise HpackError("an integer in a header block is too large")
        if not byte & 0x80:
            return <Py_ssize_t>value
        shift += 7


cdef bytes _huffman(const unsigned char* data, Py_ssize_t n):
    cdef char* out = <char*>PyMem_Malloc(n * 8 // 5 + 1)  # the shortest code is 5 bits
    cdef Py_ssize_t i, k = 0
    cdef uint32_t state = 0, step
    cdef unsigned char byte
    if out == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            byte = data[i]
            step = _STEPS[state << 4 | (byte >> 4)]
            if step & _FAIL:
                raise HpackError("a Huffman-coded string holds EOS or an invalid code")
            if not step & _NO_SYMBOL:
                out[k] = <char>(step & 0xFF)
                k += 1
            state = step >> 10
            step = _STEPS[state << 4 | (byte & 0xF)]
            if step & _FAIL:
                raise HpackError("a Huffman-coded string holds EOS or an invalid code")
            if not step & _NO_SYMBOL:
                out[k] = <char>(step & 0xFF)
                k += 1
            state = step >> 10
        if not _ACCEPTING[state]:
            raise HpackError("a Huffman-coded string ends with invalid padding")
        return PyBytes_FromStringAndSize(out, k)
    finally:
        PyMem_Free(out)


cdef bytes _string(const unsigned char* data, Py_ssize_t* pos, Py_ssize_t end):
    cdef bint huffman
    cdef Py_ssize_t length, start
    if pos[0] >= end:
        raise HpackError("a header block ends before a string")
    huffman = data[pos[0]] & 0x80
    length = _integer(data, pos, end, 7)
    start = pos[0]
    if length > end - start:
        raise HpackError("a string runs past the end of its header block")
    pos[0] = start + length
    if huffman:
        return _huffman(data + start, length)
    return PyBytes_FromStringAndSize(<const char*>data + start, length)


def huffman_decode(const unsigned char[::1] data not None):
    """A Huffman-coded string (RFC 7541 5.2)."""
    if data.shape[0] == 0:
        return b""
    return _huffman(&data[0], data.shape[0])


cdef class Decoder:
    """The decoding side of one connection's HPACK context.

    Args:
      max_table_size: the most the peer's dynamic table may hold (what the connection's
        SETTINGS_HEADER_TABLE_SIZE advertised); a size update beyond it is an error.
      max_list_size: the most a decoded header list may hold (names, values and 32
        bytes per field, as RFC 9113's SETTINGS_MAX_HEADER_LIST_SIZE counts): decoding
        stops with an error past it, so a small block cannot expand without bound.
    """

    def __init__(self, Py_ssize_t max_table_size=4096, Py_ssize_t max_list_size=65536):
        self.max_table_size = max_table_size
        self.max_list_size = max_list_size
        self.table_size = max_table_size
        self.size = 0
        self.entries = []

    def decode(self, const unsigned char[::1] block not None):
        """The header list of one complete header block."""
        cdef Py_ssize_t end = block.shape[0], pos = 0, index, size, listed = 0
        cdef const unsigned char* data
        cdef unsigned char first
        cdef list headers = []
        cdef tuple field
        cdef bytes name, value
        if end == 0:
            return headers
        data = &block[0]
        while pos < end:
            first = data[pos]
            if first & 0x80:  # indexed field
                field = self._field(_integer(data, &pos, end, 7))
            elif first & 0xE0 == 0x20:  # table size update: only before the first field
                if PyList_GET_SIZE(headers):
                    raise HpackError("a dynamic table size update after a header field")
                size = _integer(data, &pos, end, 5)
                if size > self.max_table_size:
                    raise HpackError(
                        f"a dynamic table size update to {size} is over the "
                        f"{self.max_table_size} allowed")
                self.table_size = size
                self._evict(0)
                continue
            else:  # a literal: added to the table (01), or not (0000, 0001)
                index = _integer(data, &pos, end, 6 if first & 0x40 else 4)
                if index:
                    name = <bytes>self._field(index)[0]
                else:
                    name = _string(data, &pos, end)
                value = _string(data, &pos, end)
                field = (name, value)
                if first & 0x40:
                    self._add(field)
            listed += len(<bytes>field[0]) + len(<bytes>field[1]) + _OVERHEAD
            if listed > self.max_list_size:
                raise HpackError(f"the header list is over {self.max_list_size} bytes")
            headers.append(field)
        return headers

    cdef tuple _field(self, Py_ssize_t index):
        cdef Py_ssize_t dynamic
        if index == 0:
            raise HpackError("header index 0")
        if index <= _NSTATIC:
            return <tuple>_STATIC[index - 1]
        dynamic = index - _NSTATIC
        if dynamic > PyList_GET_SIZE(self.entries):
            raise HpackError(
                f"header index {index} is past the table ({_NSTATIC + len(self.entries)})")
        return <tuple>PyList_GET_ITEM(self.entries, PyList_GET_SIZE(self.entries) - dynamic)

    cdef int _add(self, tuple field) except -1:
        cdef Py_ssize_t size = len(<bytes>field[0]) + len(<bytes>field[1]) + _OVERHEAD
        if size > self.table_size:  # an entry larger than the table empties it
            del self.entries[:]
            self.size = 0
            return 0
        self._evict(size)
        self.entries.append(field)
        self.size += size
        return 0

    cdef int _evict(self, Py_ssize_t room) except -1:
        """Drop the oldest entries until ``room`` more bytes fit."""
        cdef Py_ssize_t drop = 0, n = PyList_GET_SIZE(self.entries)
        cdef tuple field
        while drop < n and self.size + room > self.table_size:
            field = <tuple>PyList_GET_ITEM(self.entries, drop)
            self.size -= len(<bytes>field[0]) + len(<bytes>field[1]) + _OVERHEAD
            drop += 1
        if drop:
            del self.entries[:drop]
        return 0
