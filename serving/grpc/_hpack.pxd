# HPACK header blocks (RFC 7541), the C-level API of serving/grpc/_hpack.pyx.

cdef class Decoder:
    cdef readonly Py_ssize_t max_table_size  # what SETTINGS_HEADER_TABLE_SIZE advertised
    cdef readonly Py_ssize_t max_list_size    # the most a decoded header list may hold
    cdef readonly Py_ssize_t table_size       # the size the peer's encoder uses now (<= max)
    cdef readonly Py_ssize_t size             # what the entries hold now (RFC 7541 4.1)
    cdef readonly list entries                # (name, value) tuples, oldest first

    cdef tuple _field(self, Py_ssize_t index)
    cdef int _add(self, tuple field) except -1
    cdef int _evict(self, Py_ssize_t room) except -1
