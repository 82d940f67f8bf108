# Input and result handlers: the C-level API of pxrt/_handlers.pyx.

from cpython.object cimport PyObject

from pxrt._keys cimport RouteCache


# One memcpy of the assemble loop, gathered with the GIL and run without it.
ctypedef struct CopyOp:
    char* dst
    const char* src
    Py_ssize_t nbytes        # bytes per row block
    Py_ssize_t src_stride    # distance between source rows; == nbytes when contiguous
    Py_ssize_t dst_stride    # distance between destination rows
    Py_ssize_t rows          # rows to copy (one memcpy when both strides are nbytes)


cdef class InputHandler:
    cdef readonly str model
    cdef readonly tuple names
    cdef readonly tuple dtypes
    cdef readonly tuple shapes
    cdef readonly tuple row_nbytes
    cdef readonly RouteCache routes
    cdef readonly tuple dim_names       # the named dimensions, in order
    cdef readonly tuple dim_lengths     # per named dimension: its compiled lengths, sorted
    cdef readonly tuple pads            # per input: its pad value as dtype bytes
    cdef Py_ssize_t n_inputs
    cdef Py_ssize_t n_named
    # Per named dimension: where a request's length is read (input, axis), the largest
    # length, and its compiled lengths (flattened, _lengths_at[d] onwards); _lane_of maps
    # the product of per-dimension bucket indices (row-major) to a lane.
    cdef Py_ssize_t* _len_input
    cdef Py_ssize_t* _len_axis
    cdef Py_ssize_t* _len_max
    cdef Py_ssize_t* _lengths_at
    cdef Py_ssize_t* _lengths
    cdef Py_ssize_t* _lane_of
    cdef Py_ssize_t* _lens              # scratch: one request's lengths
    cdef Py_ssize_t* _row_nbytes
    # Each input's expected rank and per-example dims (flattened, _dims_at[k] onwards);
    # a named dimension d is stored as -1 - d.
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

    cdef tuple _bools                   # the positions of the bool inputs (None: none)

    cdef tuple prepare_c(self, object request, Py_ssize_t* rows)
    cdef tuple _prepare_arrays(self, object request, Py_ssize_t* rows)
    cdef int _check_bools(self, tuple arrays) except -1
    cdef tuple _prepare_memo(self, dict request, Py_ssize_t* rows)
    cdef int _remember(self, dict request, tuple perm) except -1
    cpdef tuple prepare(self, object request)
    cdef Py_ssize_t lane_c(self, tuple arrays) except -1
    cpdef Py_ssize_t assemble(self, list arrays, list starts, list counts, list buffers) except -1
    cdef Py_ssize_t _assemble_padded(self, list arrays, list starts, list counts,
                                     list buffers, Py_ssize_t total) except -1


cdef class ResultHandler:
    cdef readonly tuple names
    cdef readonly tuple dtypes
    cdef readonly tuple shapes
    cdef Py_ssize_t n_outputs
    cdef tuple _cuts                    # per output: ((axis, dimension index), ...)
    cdef bint _any_cut

    cpdef list split(self, list outputs, Py_ssize_t shard_rows, list starts, list counts,
                     bint copy=*, list lengths=*)
