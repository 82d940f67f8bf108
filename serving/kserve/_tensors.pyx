# cython: language_level=3
"""Strict decoding of KServe v2 JSON tensor data: nested (or flat) JSON lists into a
typed array, with no silent coercion.

``decode(data, shape, kind)`` walks the lists in C, checking each element's JSON type
exactly (a boolean is not an integer, ``1.0`` is not an integer, an integer is not a
boolean) and the nesting against the shape, and stores the values as int64, uint64,
float64 or uint8; the caller narrows them to the tensor's dtype with range checks.
``_tensors_py`` is the pure-Python twin; tests hold the two to identical results.
"""

from cpython.float cimport PyFloat_AS_DOUBLE, PyFloat_CheckExact
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_AsDouble, PyLong_CheckExact
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.math cimport INFINITY
from libc.stdint cimport int64_t, uint64_t

cimport numpy as cnp

import numpy as np

cnp.import_array()

# The kinds, for Python callers.
BOOL, INT, UINT, FLOAT = KIND_BOOL, KIND_INT, KIND_UINT, KIND_FLOAT
_STORAGE = {KIND_BOOL: np.uint8, KIND_INT: np.int64, KIND_UINT: np.uint64,
            KIND_FLOAT: np.float64}
_WHAT = {KIND_BOOL: "true or false", KIND_INT: "an integer", KIND_UINT: "an integer",
         KIND_FLOAT: "a number"}

cdef extern from "Python.h":
    long long PyLong_AsLongLongAndOverflow(object obj, int* overflow) except? -1
    unsigned long long PyLong_AsUnsignedLongLong(object obj) except? -1


class TensorDataError(ValueError):
    """JSON tensor data that does not match its datatype or shape."""


def _describe(item):
    text = repr(item)
    if item is True or item is False:
        return "true" if item else "false"
    if item is None:
        return "null"
    return text if len(text) <= 40 else text[:37] + "..."


cdef int _bad(object item, Py_ssize_t at, int kind, str why) except -1:
    raise TensorDataError(f"element {at} is {_describe(item)}: {why or 'expected ' + _WHAT[kind]}")


cdef Py_ssize_t _fill(object data, const Py_ssize_t* dims, int ndim, int depth, int kind,
                      char* out, Py_ssize_t at, const Range* bounds) except -1:
    cdef Py_ssize_t i, n
    cdef object item
    cdef int overflow = 0
    cdef long long v
    cdef unsigned long long u = 0
    cdef double f = 0
    if type(data) is not list:
        raise TensorDataError(
            f"expected a list of {dims[depth]} at nesting level {depth + 1} (before element "
            f"{at}), got {_describe(data)}")
    n = PyList_GET_SIZE(data)
    if n != dims[depth]:
        raise TensorDataError(
            f"a list of {n} at nesting level {depth + 1} (before element {at}) where the "
            f"shape needs {dims[depth]}")
    if depth < ndim - 1:
        for i in range(n):
            at = _fill(<object>PyList_GET_ITEM(data, i), dims, ndim, depth + 1, kind, out, at,
                       bounds)
        return at
    for i in range(n):
        item = <object>PyList_GET_ITEM(data, i)
        if kind == KIND_FLOAT:
            if PyFloat_CheckExact(item):
                f = PyFloat_AS_DOUBLE(item)
            elif PyLong_CheckExact(item):
                try:
                    f = PyLong_AsDouble(item)
                except OverflowError:
                    f = INFINITY
            else:
                _bad(item, at, kind, "")
            if f >= bounds.fmax or f <= -bounds.fmax:
                _bad(item, at, kind, "out of range")
            (<double*>out)[at] = f
        elif kind == KIND_BOOL:
            if item is True:
                (<unsigned char*>out)[at] = 1
            elif item is False:
                (<unsigned char*>out)[at] = 0
            else:
                _bad(item, at, kind, "")
        elif not PyLong_CheckExact(item):  # a bool or a float is not an integer
            _bad(item, at, kind, "")
        elif kind == KIND_INT:
            v = PyLong_AsLongLongAndOverflow(item, &overflow)
            if overflow or v < bounds.low or (v >= 0 and <unsigned long long>v > bounds.high):
                _bad(item, at, kind, "out of range")
            (<int64_t*>out)[at] = v
        else:
            v = PyLong_AsLongLongAndOverflow(item, &overflow)
            if overflow < 0 or (not overflow and v < 0):
                _bad(item, at, kind, "out of range")
            try:
                u = PyLong_AsUnsignedLongLong(item)
            except OverflowError:
                _bad(item, at, kind, "out of range")
            if u > bounds.high:
                _bad(item, at, kind, "out of range")
            (<uint64_t*>out)[at] = u
        at += 1
    return at


def decode(object data, tuple shape, int kind, low=0, high=0, double fmax=INFINITY):
    """``data`` (flat, or nested exactly as ``shape``) as a flat array of ``kind``'s
    storage dtype, every value in range (integers ``low..high``, floats below ``fmax``
    in magnitude); raises TensorDataError naming the first offending element."""
    cdef Py_ssize_t n = 1, ndim = len(shape), i
    cdef Py_ssize_t* dims
    cdef cnp.ndarray out
    cdef bint nested
    cdef Range bounds
    bounds.low = low
    bounds.high = high
    bounds.fmax = fmax
    for d in shape:
        n *= <Py_ssize_t>d
    if type(data) is not list:
        raise TensorDataError(f"'data' must be a list, got {_describe(data)}")
    nested = (ndim > 1 and PyList_GET_SIZE(data) > 0
              and type(<object>PyList_GET_ITEM(data, 0)) is list)
    if not nested and PyList_GET_SIZE(data) != n:
        raise TensorDataError(
            f"{PyList_GET_SIZE(data)} values where shape {list(shape)} needs {n}")
    out = np.empty(n, _STORAGE[kind])
    dims = <Py_ssize_t*>PyMem_Malloc(max(ndim, 1) * sizeof(Py_ssize_t))
    if dims == NULL:
        raise MemoryError()
    try:
        if nested:
            for i in range(ndim):
                dims[i] = shape[i]
            _fill(data, dims, <int>ndim, 0, kind, <char*>cnp.PyArray_DATA(out), 0, &bounds)
        else:
            dims[0] = n
            _fill(data, dims, 1, 0, kind, <char*>cnp.PyArray_DATA(out), 0, &bounds)
    finally:
        PyMem_Free(dims)
    return out
