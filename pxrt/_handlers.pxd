# Input and result handlers: the C-level API of pxrt/_handlers.pyx.

from pxrt._keys cimport RouteCache


# One memcpy of the assemble loop, gathered with the GIL and run without it.
ctypedef struct CopyOp:
    char* dst
    const char* src
    Py_ssize_t nbytes        # bytes per row block
    Py_ssize_t src_stride    # distance between source rows; == nbytes when contiguous
    Py_ssize_t rows          # rows to copy (one memcpy when contiguous)


cdef class InputHandler:
    cdef readonly str model
    cdef readonly tuple names
    cdef readonly tuple dtypes
    cdef readonly tuple shapes
    cdef readonly tuple row_nbytes
    cdef readonly RouteCache routes
    cdef Py_ssize_t n_inputs
    cdef Py_ssize_t* _row_nbytes

    cpdef tuple prepare(self, object request)
    cpdef Py_ssize_t assemble(self, list arrays, list starts, list counts, list buffers) except -1


cdef class ResultHandler:
    cdef readonly tuple names
    cdef readonly tuple dtypes
    cdef readonly tuple shapes
    cdef Py_ssize_t n_outputs

    cpdef list split(self, list outputs, Py_ssize_t shard_rows, list starts, list counts,
                     bint copy=*)
