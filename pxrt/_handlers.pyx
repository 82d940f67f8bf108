# cython: language_level=3
"""Input and result handlers: the per-request and per-batch work of the hot path.

``InputHandler.prepare`` validates a request through the signature-key route cache (the
full check in ``_validate`` runs once per new signature), ``InputHandler.assemble`` copies
many requests into one staging slot with a GIL-free memcpy loop, and
``ResultHandler.split`` hands each request its rows of the per-device outputs as views.
``_handlers_py`` is the pure-Python twin; tests hold the two to identical results.
"""

cimport numpy as cnp
from cpython.dict cimport PyDict_Next, PyDict_Size
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport Py_EQ, PyObject, PyObject_RichCompareBool, PyTypeObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport uint64_t
from libc.string cimport memcpy, memset

from pxrt._keys cimport RouteCache, signature_of

import numpy as np

from ._handlers_py import split_pieces
from ._validate import bad_bool_error, check_lanes, inner_contiguous, validate

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    # Declared here because numpy's pxd leaves it out; it steals a reference to descr.
    object PyArray_NewFromDescr(PyTypeObject* subtype, cnp.PyArray_Descr* descr, int nd,
                                cnp.npy_intp* dims, cnp.npy_intp* strides, void* data,
                                int flags, PyObject* obj)

# Hot-path lookups cached as C-level globals.
cdef object _ndarray = np.ndarray
cdef object _ascontiguousarray = np.ascontiguousarray
cdef object _concatenate = np.concatenate


cdef inline bint _over_one(const unsigned char* p, Py_ssize_t n) noexcept nogil:
    # Whether any of the n bytes at p is > 1 (not a valid bool): OR them together eight
    # at a time and look at the high seven bits of each byte once.
    cdef uint64_t acc = 0, word
    cdef Py_ssize_t i = 0
    while i + 8 <= n:
        memcpy(&word, p + i, 8)
        acc |= word
        i += 8
    while i < n:
        acc |= p[i]
        i += 1
    return (acc & <uint64_t>0xFEFEFEFEFEFEFEFE) != 0


cdef inline bint _rows_contiguous(cnp.ndarray arr, Py_ssize_t row_nbytes):
    # Each row one block; the row stride itself may be anything (even 0 or negative).
    if cnp.PyArray_IS_C_CONTIGUOUS(arr):
        return True
    return inner_contiguous(arr)


cdef class InputHandler:
    """Validates requests against a model's inputs and assembles batches.

    Args:
      model: the model name, used in error messages.
      names, dtypes, shapes: the model's inputs, in order, with per-example shapes.
      max_routes: bound of the signature -> route cache.
    """

    def __cinit__(self):
        self._row_nbytes = NULL
        self._ndim = NULL
        self._dims_at = NULL
        self._dims = NULL
        self._memo_names = NULL
        self._memo_descrs = NULL
        self._memo_input = NULL
        self._scratch = NULL
        self._len_input = NULL
        self._len_axis = NULL
        self._len_max = NULL
        self._lengths_at = NULL
        self._lengths = NULL
        self._lane_of = NULL
        self._lens = NULL
        self._memo_valid = False

    def __init__(self, str model, names, dtypes, shapes, Py_ssize_t max_routes=256,
                 dim_lengths=None, lane_of=None, pads=None):
        cdef Py_ssize_t i, d, at = 0, n, k
        self.model = model
        self.names = tuple(names)
        self.dtypes = tuple(np.dtype(d) for d in dtypes)
        self.shapes = tuple(tuple(s) for s in shapes)
        self.n_inputs = n = len(self.names)
        self.dim_names = tuple(dict.fromkeys(d for s in self.shapes for d in s
                                             if isinstance(d, str)))
        self.n_named = len(self.dim_names)
        self.dim_lengths, lanes = check_lanes(self.dim_names, dim_lengths, lane_of)
        self.pads = tuple(np.array(0 if pads is None else pads[k], dt).tobytes()
                          for k, dt in enumerate(self.dtypes))
        if any(len(p) != dt.itemsize for p, dt in zip(self.pads, self.dtypes)):
            raise ValueError(f"pads must be one scalar per input, got {pads!r}")
        self.row_nbytes = tuple(
            0 if any(isinstance(d, str) for d in s) else
            int(np.prod(s, dtype=np.int64)) * dt.itemsize
            for dt, s in zip(self.dtypes, self.shapes))
        m = max(n, 1)
        q = max(self.n_named, 1)
        self._row_nbytes = <Py_ssize_t*>PyMem_Malloc(m * sizeof(Py_ssize_t))
        self._ndim = <int*>PyMem_Malloc(m * sizeof(int))
        self._dims_at = <Py_ssize_t*>PyMem_Malloc(m * sizeof(Py_ssize_t))
        self._dims = <Py_ssize_t*>PyMem_Malloc(
            max(sum(len(s) for s in self.shapes), 1) * sizeof(Py_ssize_t))
        self._memo_names = <PyObject**>PyMem_Malloc(m * sizeof(PyObject*))
        self._memo_descrs = <PyObject**>PyMem_Malloc(m * sizeof(PyObject*))
        self._memo_input = <Py_ssize_t*>PyMem_Malloc(m * sizeof(Py_ssize_t))
        self._scratch = <PyObject**>PyMem_Malloc(m * sizeof(PyObject*))
        self._len_input = <Py_ssize_t*>PyMem_Malloc(q * sizeof(Py_ssize_t))
        self._len_axis = <Py_ssize_t*>PyMem_Malloc(q * sizeof(Py_ssize_t))
        self._len_max = <Py_ssize_t*>PyMem_Malloc(q * sizeof(Py_ssize_t))
        self._lengths_at = <Py_ssize_t*>PyMem_Malloc(q * sizeof(Py_ssize_t))
        self._lens = <Py_ssize_t*>PyMem_Malloc(q * sizeof(Py_ssize_t))
        self._lengths = <Py_ssize_t*>PyMem_Malloc(
            max(sum(len(v) for v in self.dim_lengths), 1) * sizeof(Py_ssize_t))
        self._lane_of = <Py_ssize_t*>PyMem_Malloc(max(len(lanes), 1) * sizeof(Py_ssize_t))
        if (self._row_nbytes == NULL or self._ndim == NULL or self._dims_at == NULL
                or self._dims == NULL or self._memo_names == NULL or self._memo_descrs == NULL
                or self._memo_input == NULL or self._scratch == NULL
                or self._len_input == NULL or self._len_axis == NULL or self._len_max == NULL
                or self._lengths_at == NULL or self._lens == NULL or self._lengths == NULL
                or self._lane_of == NULL):
            raise MemoryError()
        for d in range(self.n_named):
            self._len_input[d] = -1
        for i in range(n):
            self._row_nbytes[i] = self.row_nbytes[i]
            self._ndim[i] = len(self.shapes[i]) + 1
            self._dims_at[i] = at
            for axis, dim in enumerate(self.shapes[i], 1):
                if isinstance(dim, str):
                    j = self.dim_names.index(dim)
                    self._dims[at] = -1 - j
                    if self._len_input[j] < 0:
                        self._len_input[j] = i
                        self._len_axis[j] = axis
                else:
                    self._dims[at] = dim
                at += 1
        at = 0
        for d in range(self.n_named):
            self._lengths_at[d] = at
            self._len_max[d] = max(self.dim_lengths[d])
            for length in self.dim_lengths[d]:
                self._lengths[at] = length
                at += 1
        for i, lane in enumerate(lanes):
            self._lane_of[i] = lane
        self.routes = RouteCache(max_routes)
        bools = tuple(k for k, dt in enumerate(self.dtypes) if dt == np.bool_)
        self._bools = bools or None

    def __dealloc__(self):
        PyMem_Free(self._row_nbytes)
        PyMem_Free(self._ndim)
        PyMem_Free(self._dims_at)
        PyMem_Free(self._dims)
        PyMem_Free(self._memo_names)
        PyMem_Free(self._memo_descrs)
        PyMem_Free(self._memo_input)
        PyMem_Free(self._scratch)
        PyMem_Free(self._len_input)
        PyMem_Free(self._len_axis)
        PyMem_Free(self._len_max)
        PyMem_Free(self._lengths_at)
        PyMem_Free(self._lengths)
        PyMem_Free(self._lane_of)
        PyMem_Free(self._lens)

    @property
    def dim_max(self):
        """Named dimension -> the largest length a request may have."""
        return {d: max(lengths) for d, lengths in zip(self.dim_names, self.dim_lengths)}

    def _validate(self, request):
        return validate(self.model, self.names, self.dtypes, self.shapes, request,
                        self.dim_max)

    cdef tuple _prepare_memo(self, dict request, Py_ssize_t* rows_out):
        # The request's arrays in input order if it has the last signature seen and
        # C-contiguous arrays of agreeing rows (>= 1); else None (the route cache, or
        # the full check, decides). No key tuple, no hashing: pointer compares.
        cdef Py_ssize_t pos = 0, i = 0, k, d, at, rows = 0, n = self.n_inputs, want, named
        cdef PyObject* pkey
        cdef PyObject* pvalue
        cdef cnp.ndarray arr
        cdef cnp.npy_intp* dims
        cdef tuple arrays
        if not self._memo_valid or PyDict_Size(request) != n:
            return None
        for d in range(self.n_named):
            self._lens[d] = -1
        while PyDict_Next(request, &pos, &pkey, &pvalue):
            if pkey != self._memo_names[i]:
                if PyObject_RichCompareBool(<object>pkey, <object>self._memo_names[i], Py_EQ) != 1:
                    return None
            if not cnp.PyArray_CheckExact(<object>pvalue):
                return None
            arr = <cnp.ndarray>pvalue
            if <PyObject*>cnp.PyArray_DESCR(arr) != self._memo_descrs[i]:
                return None
            k = self._memo_input[i]
            if cnp.PyArray_NDIM(arr) != self._ndim[k] or not cnp.PyArray_IS_C_CONTIGUOUS(arr):
                return None
            dims = cnp.PyArray_DIMS(arr)
            at = self._dims_at[k]
            for d in range(1, self._ndim[k]):
                want = self._dims[at + d - 1]
                if want >= 0:
                    if dims[d] != want:
                        return None
                    continue
                named = -1 - want
                if self._lens[named] < 0:
                    if dims[d] < 1 or dims[d] > self._len_max[named]:
                        return None
                    self._lens[named] = dims[d]
                elif self._lens[named] != dims[d]:
                    return None
            if i == 0:
                rows = dims[0]
            elif dims[0] != rows:
                return None
            self._scratch[k] = pvalue
            i += 1
        if rows < 1:
            return None
        arrays = PyTuple_New(n)
        for k in range(n):
            Py_INCREF(<object>self._scratch[k])
            PyTuple_SET_ITEM(arrays, k, <object>self._scratch[k])
        rows_out[0] = rows
        return arrays

    cdef int _remember(self, dict request, tuple perm) except -1:
        # Make the inline cache hold this (validated) request's signature.
        cdef Py_ssize_t i, k
        cdef tuple names = tuple(request)
        cdef tuple descrs = tuple([v.dtype for v in request.values()])
        self._memo_valid = False
        for i in range(self.n_inputs):
            self._memo_names[i] = <PyObject*>names[i]
            self._memo_descrs[i] = <PyObject*>descrs[i]
        for k in range(self.n_inputs):
            self._memo_input[<Py_ssize_t>perm[k]] = k
        self._memo_keep = (names, descrs)
        self._memo_valid = True
        return 0

    cdef tuple prepare_c(self, object request, Py_ssize_t* rows_out):
        """``prepare`` for C callers: the arrays, with the rows in ``rows_out``."""
        cdef tuple arrays = self._prepare_arrays(request, rows_out)
        if self._bools is not None:
            self._check_bools(arrays)
        return arrays

    cdef int _check_bools(self, tuple arrays) except -1:
        # A bool is the byte 0 or 1. numpy does not check bytes that become bools
        # (np.frombuffer(data, bool), .view(bool)) and XLA gives other bytes no meaning:
        # refused here, per request, so the requests batched with it still run.
        cdef object k
        cdef cnp.ndarray arr
        cdef bint bad
        for k in self._bools:
            arr = <cnp.ndarray>arrays[k]
            if cnp.PyArray_IS_C_CONTIGUOUS(arr):
                bad = _over_one(<const unsigned char*>cnp.PyArray_DATA(arr),
                                cnp.PyArray_NBYTES(arr))
            else:
                bad = bool((arr.view(np.uint8) > 1).any())
            if bad:
                raise bad_bool_error(self.model, self.names[k], arr)
        return 0

    cdef tuple _prepare_arrays(self, object request, Py_ssize_t* rows_out):
        cdef tuple arrays
        cdef object key, perm
        cdef list values
        cdef Py_ssize_t i, rows
        cdef cnp.ndarray arr
        cdef bint contiguous = True
        if type(request) is dict:
            arrays = self._prepare_memo(<dict>request, rows_out)
            if arrays is not None:
                return arrays
        key = signature_of(request)
        perm = self.routes.get(key) if key is not None else None
        if perm is None:
            arrays, rows = self._validate(request)
            if key is not None:
                order = list(request)
                perm = tuple([order.index(n) for n in self.names])
                self.routes.put(key, perm)
                self._remember(<dict>request, <tuple>perm)
            rows_out[0] = rows
            return arrays
        values = list((<dict>request).values())
        arrays = tuple([values[p] for p in <tuple>perm])
        rows = cnp.PyArray_DIMS(<cnp.ndarray>arrays[0])[0]
        for i in range(self.n_inputs):
            arr = <cnp.ndarray>arrays[i]
            if cnp.PyArray_DIMS(arr)[0] != rows or rows < 1:
                # Same signature, different row counts (or none): the full check words it.
                arrays, rows = self._validate(request)
                rows_out[0] = rows
                return arrays
            if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
                contiguous = False
        if not contiguous:
            arrays = tuple([a if inner_contiguous(a) else _ascontiguousarray(a) for a in arrays])
        else:
            self._remember(<dict>request, <tuple>perm)
        rows_out[0] = rows
        return arrays

    def clear_routes(self):
        """Forget every signature seen (the route cache and its inline entry)."""
        self._memo_valid = False
        self._memo_keep = None
        self.routes.clear()

    cpdef tuple prepare(self, object request):
        """Validate one request; returns its arrays in model input order and its rows."""
        cdef Py_ssize_t rows = 0
        cdef tuple arrays = self.prepare_c(request, &rows)
        return arrays, rows

    cdef Py_ssize_t lane_c(self, tuple arrays) except -1:
        # The lane of prepared arrays: the smallest compiled lengths that hold them.
        cdef Py_ssize_t d, flat = 0, length, lo, hi, mid, at, count
        for d in range(self.n_named):
            length = cnp.PyArray_DIMS(<cnp.ndarray>arrays[self._len_input[d]])[
                self._len_axis[d]]
            at = self._lengths_at[d]
            count = len(<tuple>self.dim_lengths[d])
            lo = 0
            hi = count
            while lo < hi:
                mid = (lo + hi) >> 1
                if self._lengths[at + mid] < length:
                    lo = mid + 1
                else:
                    hi = mid
            if lo == count:
                raise ValueError(f"dimension {self.dim_names[d]!r} is {length}, over the "
                                 f"largest compiled length {self._len_max[d]}")
            flat = flat * count + lo
        if not self.n_named:
            return 0
        if self._lane_of[flat] < 0:
            raise ValueError(f"model {self.model!r}: no compiled cell holds lengths "
                             f"{dict(zip(self.dim_names, self.lengths_of(arrays)))}")
        return self._lane_of[flat]

    def lane_of(self, tuple arrays):
        """The lane (compiled lengths) that prepared ``arrays`` run in; 0 without
        named dimensions."""
        cdef Py_ssize_t d
        if len(arrays) != self.n_inputs:
            raise ValueError(f"expected {self.n_inputs} arrays (InputHandler.prepare's)")
        for d in range(self.n_named):
            arr = arrays[self._len_input[d]]
            if type(arr) is not np.ndarray or (<cnp.ndarray>arr).ndim <= self._len_axis[d]:
                raise ValueError("lane_of takes the arrays InputHandler.prepare returned")
        return self.lane_c(arrays)

    def lengths_of(self, tuple arrays):
        """Prepared ``arrays``' length along each named dimension, in order."""
        return tuple([(<object>arrays[self._len_input[d]]).shape[self._len_axis[d]]
                      for d in range(self.n_named)])

    cpdef Py_ssize_t assemble(self, list arrays, list starts, list counts,
                              list buffers) except -1:
        """Copy rows ``starts[i]:starts[i]+counts[i]`` of each piece ``arrays[i]`` (a
        tuple in input order, from ``prepare``) into consecutive rows of ``buffers``
        (one ``(bucket, ...)`` staging buffer per input), zero the rows after them, and
        return the number of rows written."""
        cdef Py_ssize_t n_pieces = len(arrays)
        cdef Py_ssize_t i, j, k = 0, r, start, count, total = 0, offset, rb, cap
        cdef cnp.ndarray src, buf
        cdef object piece
        cdef char* dst
        cdef CopyOp* ops
        cdef CopyOp* op
        cdef Py_ssize_t n_ops = n_pieces * self.n_inputs
        cdef char** pad_dst
        cdef Py_ssize_t* pad_len
        if len(starts) != n_pieces or len(counts) != n_pieces:
            raise ValueError("arrays, starts and counts must have the same length")
        if len(buffers) != self.n_inputs:
            raise ValueError(f"expected {self.n_inputs} staging buffers, got {len(buffers)}")
        for i in range(n_pieces):
            piece = arrays[i]
            if type(piece) is not tuple or len(<tuple>piece) != self.n_inputs:
                raise ValueError(f"piece {i} must be a tuple of {self.n_inputs} arrays "
                                 f"(InputHandler.prepare's), got {type(piece).__name__}")
            total += <Py_ssize_t>counts[i]
        if self.n_named:
            return self._assemble_padded(arrays, starts, counts, buffers, total)
        ops = <CopyOp*>PyMem_Malloc((n_ops + 1) * sizeof(CopyOp))
        pad_dst = <char**>PyMem_Malloc((self.n_inputs + 1) * sizeof(char*))
        pad_len = <Py_ssize_t*>PyMem_Malloc((self.n_inputs + 1) * sizeof(Py_ssize_t))
        if ops == NULL or pad_dst == NULL or pad_len == NULL:
            PyMem_Free(ops); PyMem_Free(pad_dst); PyMem_Free(pad_len)
            raise MemoryError()
        try:
            # With the GIL: check every bound, so the loop below cannot write out of place.
            for j in range(self.n_inputs):
                buf = <cnp.ndarray?>buffers[j]
                rb = self._row_nbytes[j]
                cap = cnp.PyArray_DIMS(buf)[0] if cnp.PyArray_NDIM(buf) > 0 else 0
                if (not cnp.PyArray_IS_C_CONTIGUOUS(buf) or not cnp.PyArray_ISWRITEABLE(buf)
                        or cnp.PyArray_NBYTES(buf) != cap * rb):
                    raise ValueError(f"staging buffer {j} is not a writeable C-contiguous "
                                     f"buffer of rows of {rb} bytes")
                if total > cap:
                    raise ValueError(f"{total} rows do not fit a staging buffer of {cap}")
                dst = cnp.PyArray_BYTES(buf)
                offset = 0
                for i in range(n_pieces):
                    src = <cnp.ndarray?>(<tuple>arrays[i])[j]
                    start = starts[i]
                    count = counts[i]
                    if (cnp.PyArray_NDIM(src) < 1 or start < 0 or count < 0
                            or count > cnp.PyArray_DIMS(src)[0] - start
                            or cnp.PyArray_ITEMSIZE(src) * (cnp.PyArray_SIZE(src) //
                                max(cnp.PyArray_DIMS(src)[0], 1)) != rb
                            or not _rows_contiguous(src, rb)):
                        raise ValueError(f"piece {i}, input {self.names[j]!r}: rows "
                                         f"{start}:{start + count} do not fit the input")
                    op = &ops[k]
                    op.dst = dst + offset * rb
                    op.src = cnp.PyArray_BYTES(src) + start * cnp.PyArray_STRIDES(src)[0]
                    op.nbytes = rb
                    op.src_stride = cnp.PyArray_STRIDES(src)[0]
                    op.dst_stride = rb
                    op.rows = count
                    k += 1
                    offset += count
                pad_dst[j] = dst + total * rb
                pad_len[j] = (cap - total) * rb
            with nogil:
                _run_ops(ops, k)
            for j in range(self.n_inputs):
                _fill(pad_dst[j], pad_len[j], self.pads[j])
        finally:
            PyMem_Free(ops)
            PyMem_Free(pad_dst)
            PyMem_Free(pad_len)
        return total


    cdef Py_ssize_t _assemble_padded(self, list arrays, list starts, list counts,
                                     list buffers, Py_ssize_t total) except -1:
        # With named dimensions: each buffer is (bucket, *lengths of the cell); every
        # piece's rows go into the corner of their rows, the rest is the input's pad.
        cdef Py_ssize_t n_pieces = len(arrays)
        cdef Py_ssize_t i, j, d, nd, cap, offset, start, count, n_ops = 0, k = 0, inner
        cdef Py_ssize_t chunk, chunks, c, src_off, dst_off, item
        cdef cnp.ndarray src, buf
        cdef cnp.npy_intp* sdims
        cdef cnp.npy_intp* tdims
        cdef Py_ssize_t sstride[32]
        cdef Py_ssize_t tstride[32]
        cdef Py_ssize_t idx[32]
        cdef CopyOp* ops = NULL
        cdef CopyOp* op
        if len(buffers) != self.n_inputs:
            raise ValueError(f"expected {self.n_inputs} staging buffers, got {len(buffers)}")
        # With the GIL: check every bound and count the copies.
        for j in range(self.n_inputs):
            buf = <cnp.ndarray?>buffers[j]
            nd = cnp.PyArray_NDIM(buf)
            if (nd != self._ndim[j] or nd > 32 or not cnp.PyArray_IS_C_CONTIGUOUS(buf)
                    or not cnp.PyArray_ISWRITEABLE(buf)
                    or (<object>buf).dtype != self.dtypes[j]):
                raise ValueError(f"staging buffer {j} is not a writeable C-contiguous "
                                 f"{self.dtypes[j]} buffer of rank {self._ndim[j]}")
            tdims = cnp.PyArray_DIMS(buf)
            if total > tdims[0]:
                raise ValueError(f"{total} rows do not fit a staging buffer of {tdims[0]}")
            for i in range(n_pieces):
                src = <cnp.ndarray?>(<tuple>arrays[i])[j]
                start = starts[i]
                count = counts[i]
                sdims = cnp.PyArray_DIMS(src)
                if (cnp.PyArray_NDIM(src) != nd or start < 0 or count < 0
                        or count > sdims[0] - start
                        or cnp.PyArray_ITEMSIZE(src) != cnp.PyArray_ITEMSIZE(buf)
                        or not _rows_contiguous(src, 0)):
                    raise ValueError(f"piece {i}, input {self.names[j]!r}: rows "
                                     f"{start}:{start + count} do not fit the input")
                inner = nd - 1
                while inner > 0 and sdims[inner] == tdims[inner]:
                    inner -= 1
                chunks = 1
                for d in range(1, inner):
                    chunks *= sdims[d]
                for d in range(1, nd):
                    if sdims[d] > tdims[d]:
                        raise ValueError(f"piece {i}, input {self.names[j]!r}: shape "
                                         f"{(<object>src).shape[1:]} does not fit "
                                         f"{(<object>buf).shape[1:]}")
                n_ops += chunks
        ops = <CopyOp*>PyMem_Malloc((n_ops + 1) * sizeof(CopyOp))
        if ops == NULL:
            raise MemoryError()
        try:
            for j in range(self.n_inputs):
                buf = <cnp.ndarray>buffers[j]
                nd = cnp.PyArray_NDIM(buf)
                tdims = cnp.PyArray_DIMS(buf)
                item = self.dtypes[j].itemsize
                _fill(cnp.PyArray_BYTES(buf), cnp.PyArray_NBYTES(buf), self.pads[j])
                offset = 0
                for i in range(n_pieces):
                    src = <cnp.ndarray>(<tuple>arrays[i])[j]
                    start = starts[i]
                    count = counts[i]
                    sdims = cnp.PyArray_DIMS(src)
                    # Element strides of one example, source (its own dims) and target.
                    sstride[nd - 1] = item
                    tstride[nd - 1] = item
                    for d in range(nd - 2, -1, -1):
                        sstride[d] = sstride[d + 1] * sdims[d + 1]
                        tstride[d] = tstride[d + 1] * tdims[d + 1]
                    inner = nd - 1
                    while inner > 0 and sdims[inner] == tdims[inner]:
                        inner -= 1
                    # One chunk: the source's extent of axes inner.. (the target's past it).
                    chunk = sstride[inner] * sdims[inner] if inner > 0 else sstride[0]
                    chunks = 1
                    for d in range(1, inner):
                        chunks *= sdims[d]
                        idx[d] = 0
                    for c in range(chunks):
                        src_off = 0
                        dst_off = 0
                        for d in range(1, inner):
                            src_off += idx[d] * sstride[d]
                            dst_off += idx[d] * tstride[d]
                        op = &ops[k]
                        op.dst = cnp.PyArray_BYTES(buf) + offset * tstride[0] + dst_off
                        op.src = (cnp.PyArray_BYTES(src) + start * cnp.PyArray_STRIDES(src)[0]
                                  + src_off)
                        op.nbytes = chunk
                        op.src_stride = cnp.PyArray_STRIDES(src)[0]
                        op.dst_stride = tstride[0]
                        op.rows = count
                        k += 1
                        d = inner - 1
                        while d >= 1:
                            idx[d] += 1
                            if idx[d] < sdims[d]:
                                break
                            idx[d] = 0
                            d -= 1
                    offset += count
            with nogil:
                _run_ops(ops, k)
        finally:
            PyMem_Free(ops)
        return total


cdef inline void _run_ops(CopyOp* ops, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i, r
    cdef CopyOp* op
    for i in range(n):
        op = &ops[i]
        if op.src_stride == op.nbytes and op.dst_stride == op.nbytes:
            memcpy(op.dst, op.src, op.nbytes * op.rows)
        else:
            for r in range(op.rows):
                memcpy(op.dst + r * op.dst_stride, op.src + r * op.src_stride, op.nbytes)


cdef void _fill(char* dst, Py_ssize_t nbytes, bytes pattern):
    # Fill nbytes with copies of one element's bytes: memset for zeros, else doubling.
    cdef Py_ssize_t item = len(pattern), done
    cdef const char* p = pattern
    cdef bint zero = True
    for done in range(item):
        if p[done] != 0:
            zero = False
    if nbytes <= 0:
        return
    if zero:
        memset(dst, 0, nbytes)
        return
    memcpy(dst, p, item)
    done = item
    while done < nbytes:
        memcpy(dst + done, dst, min(done, nbytes - done))
        done += min(done, nbytes - done)


cdef class ResultHandler:
    """Splits per-device output shards back into per-request outputs.

    Args:
      names, dtypes, shapes: the model's outputs, in order, with per-example shapes.
    """

    def __init__(self, names, dtypes, shapes, dim_names=()):
        self.names = tuple(names)
        self.dtypes = tuple(np.dtype(d) for d in dtypes)
        self.shapes = tuple(tuple(s) for s in shapes)
        self.n_outputs = len(self.names)
        self._cuts = _cuts(self.shapes, tuple(dim_names))
        self._any_cut = any(self._cuts)

    cpdef list split(self, list outputs, Py_ssize_t shard_rows, list starts, list counts,
                     bint copy=False, list lengths=None):
        """``outputs[k]`` holds output k's shards in row order, ``shard_rows`` rows each.
        Returns, per piece, a dict name -> rows ``starts[i]:starts[i]+counts[i]``: a view
        of a shard when the piece lies inside one (unless ``copy``), else a new array.
        Outputs with named dimensions are cut to ``lengths[i]`` (the piece's length per
        named dimension) along them."""
        cdef Py_ssize_t n_pieces = len(starts)
        cdef Py_ssize_t i, k, s, start, count, first, offset, rb, n_shards, take, row
        cdef list results = []
        cdef list shard_lists = []
        cdef list shards
        cdef cnp.ndarray shard, arr
        cdef cnp.npy_intp dims[32]
        cdef cnp.PyArray_Descr* descr
        cdef dict out
        cdef int nd, d, flags
        if len(counts) != n_pieces:
            raise ValueError("starts and counts must have the same length")
        if shard_rows < 1:
            raise ValueError(f"shard_rows must be >= 1, got {shard_rows}")
        if len(outputs) != self.n_outputs:
            raise ValueError(f"expected {self.n_outputs} outputs, got {len(outputs)}")
        for k in range(self.n_outputs):
            shards = list(outputs[k])
            for s in range(len(shards)):
                shard = <cnp.ndarray?>shards[s]
                if (cnp.PyArray_NDIM(shard) < 1 or cnp.PyArray_NDIM(shard) > 32
                        or cnp.PyArray_DIMS(shard)[0] != shard_rows):
                    raise ValueError(f"output {self.names[k]!r} shard {s} has shape "
                                     f"{(<object>shard).shape}, expected {shard_rows} rows")
                if not cnp.PyArray_IS_C_CONTIGUOUS(shard):
                    shards[s] = _ascontiguousarray(shard)
            shard_lists.append(shards)
        if self._any_cut:
            if lengths is None or len(lengths) != n_pieces:
                raise ValueError("outputs with named dimensions need each piece's lengths")
            # Cutting to lengths is numpy slicing either way: the twin's code, shared.
            return split_pieces(self.names, self._cuts, shard_lists, shard_rows, starts,
                                counts, copy, lengths)
        for i in range(n_pieces):
            start = starts[i]
            count = counts[i]
            first = start // shard_rows
            offset = start - first * shard_rows
            out = {}
            for k in range(self.n_outputs):
                shards = <list>shard_lists[k]
                n_shards = len(shards)
                if start < 0 or count < 1 or start + count > n_shards * shard_rows:
                    raise ValueError(f"rows {start}:{start + count} out of range for "
                                     f"{n_shards * shard_rows} rows")
                shard = <cnp.ndarray>shards[first]
                nd = cnp.PyArray_NDIM(shard)
                rb = cnp.PyArray_NBYTES(shard) // shard_rows
                for d in range(1, nd):
                    dims[d] = cnp.PyArray_DIMS(shard)[d]
                dims[0] = count
                descr = cnp.PyArray_DESCR(shard)
                if offset + count <= shard_rows and not copy:
                    # A view of the shard: it keeps the shard (and its device buffer) alive.
                    flags = cnp.NPY_ARRAY_C_CONTIGUOUS | cnp.NPY_ARRAY_ALIGNED
                    if cnp.PyArray_ISWRITEABLE(shard):
                        flags |= cnp.NPY_ARRAY_WRITEABLE
                    Py_INCREF(<object>descr)
                    arr = PyArray_NewFromDescr(<PyTypeObject*>_ndarray, descr, nd, dims, NULL,
                                               cnp.PyArray_BYTES(shard) + offset * rb,
                                               flags, NULL)
                    cnp.set_array_base(arr, shard)
                else:
                    Py_INCREF(<object>descr)
                    arr = PyArray_NewFromDescr(<PyTypeObject*>_ndarray, descr, nd, dims, NULL, NULL, 0,
                                               NULL)
                    row = 0
                    s = first
                    take = min(count, shard_rows - offset)
                    # Pieces that straddle shards are rare and small: copy with the GIL held.
                    memcpy(cnp.PyArray_BYTES(arr), cnp.PyArray_BYTES(shard) + offset * rb,
                           take * rb)
                    row = take
                    while row < count:
                        s += 1
                        shard = <cnp.ndarray>shards[s]
                        take = min(count - row, shard_rows)
                        memcpy(cnp.PyArray_BYTES(arr) + row * rb, cnp.PyArray_BYTES(shard),
                               take * rb)
                        row += take
                    if not copy:  # outputs are read-only unless the caller asked for copies
                        cnp.PyArray_CLEARFLAGS(arr, cnp.NPY_ARRAY_WRITEABLE)
                out[self.names[k]] = arr
            results.append(out)
        return results


def _cuts(tuple shapes, tuple dim_names):
    # Per output: ((axis of the full array, index of its named dimension), ...).
    cuts = []
    for shape in shapes:
        cut = []
        for axis, d in enumerate(shape, 1):
            if isinstance(d, str):
                if d not in dim_names:
                    raise ValueError(f"output dimension {d!r} is not one of the inputs' "
                                     f"named dimensions {list(dim_names)}")
                cut.append((axis, dim_names.index(d)))
        cuts.append(tuple(cut))
    return tuple(cuts)
