# cython: language_level=3
"""Fast-path cache keys: a request (dict name -> ndarray) to a hashable signature.

The key is one flat tuple built straight from the C array headers: per input in the
request's order ``name, dtype.num, dtype.isnative, ndim, *shape[1:]``; ``ndim`` says how
many dims follow, so the tuple is unambiguous. ``dtype.num`` is unique per dtype within a
process (bfloat16 is a user type with a num of its own), and ``isnative`` separates
``>f4`` from ``<f4``. The pure-Python twin (``_keys_py``) builds the identical tuple.
"""

cimport numpy as cnp
from cpython.dict cimport PyDict_Next, PyDict_Size
from cpython.long cimport PyLong_FromSsize_t
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM

cnp.import_array()


cdef object signature_of(object request):
    cdef Py_ssize_t pos = 0, size = 0, i, k = 0, nd
    cdef PyObject* pkey
    cdef PyObject* pvalue
    cdef cnp.ndarray arr
    cdef cnp.dtype descr
    cdef cnp.npy_intp* dims
    cdef object item
    if type(request) is not dict:
        return None
    # First pass: check the types and size the key.
    while PyDict_Next(request, &pos, &pkey, &pvalue):
        if not cnp.PyArray_CheckExact(<object>pvalue):
            return None
        nd = cnp.PyArray_NDIM(<cnp.ndarray>pvalue)
        size += 4 + (nd - 1 if nd > 0 else 0)
    key = PyTuple_New(size)
    pos = 0
    while PyDict_Next(request, &pos, &pkey, &pvalue):
        arr = <cnp.ndarray>pvalue
        descr = <cnp.dtype>cnp.PyArray_DESCR(arr)
        nd = cnp.PyArray_NDIM(arr)
        dims = cnp.PyArray_DIMS(arr)
        item = <object>pkey
        Py_INCREF(item)
        PyTuple_SET_ITEM(key, k, item)
        item = descr.type_num
        Py_INCREF(item)
        PyTuple_SET_ITEM(key, k + 1, item)
        item = cnp.PyArray_ISNBO(descr.byteorder)
        Py_INCREF(item)
        PyTuple_SET_ITEM(key, k + 2, item)
        item = nd
        Py_INCREF(item)
        PyTuple_SET_ITEM(key, k + 3, item)
        k += 4
        for i in range(1, nd):
            item = PyLong_FromSsize_t(dims[i])
            Py_INCREF(item)
            PyTuple_SET_ITEM(key, k, item)
            k += 1
    return key


def signature(request):
    """The fast-path cache key of a request, or None when the request is not a plain
    dict of plain ndarrays (such requests always take the full validation path)."""
    return signature_of(request)


cdef class RouteCache:
    """A bounded signature -> route map. When full, the oldest entry goes first."""

    def __init__(self, Py_ssize_t maxsize=256):
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._entries = {}

    cpdef object get(self, object key):
        return self._entries.get(key)

    cpdef put(self, object key, object route):
        entries = self._entries
        if key not in entries and PyDict_Size(entries) >= self.maxsize:
            del entries[next(iter(entries))]
        entries[key] = route

    cpdef clear(self):
        self._entries.clear()

    def __len__(self):
        return PyDict_Size(self._entries)

    def __contains__(self, key):
        return key in self._entries
