# Input and result handlers: the C-level API of pxrt/_handlers.pyx.

from cpython.object cimport PyObject

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
    # Each input's expected rank and per-example dims (flattened, _dims_at[k] onwards).
    cdef int* _ndim
    cdef Py_ssize_t* _dims_at
    cdef Py_ssize_t* _dims
    # One-entry inline cache in front of the route cache: the last signature seen, as
    # borrowed pointers kept alive by _memo_keep. Position i of a request in that
    # signature has name _memo_names[i], dtype _memo_descrs[i], and is input _memo_input[i].
    cdef bint _memo_valid
    cdef object _memo_keep
    cdef PyObject** _memo_names
    cdef PyObject** _memo_descrs
    cdef Py_ssize_t* _memo_input
    cdef PyObject** _scratch

    cdef tuple prepare_c(self, object request, Py_ssize_t* rows)
    cdef tuple _prepare_memo(self, dict request, Py_ssize_t* rows)
    cdef int _remember(self, dict request, tuple perm) except -1
    cpdef tuple prepare(self, object request)
    cpdef Py_ssize_t assemble(self, list arrays, list starts, list counts, list buffers) except -1


cdef class ResultHandler:
    cdef readonly tuple names
    cdef readonly tuple dtypes
    cdef readonly tuple shapes
    cdef Py_ssize_t n_outputs

    cpdef list split(self, list outputs, Py_ssize_t shard_rows, list starts, list counts,
                     bint copy=*)
