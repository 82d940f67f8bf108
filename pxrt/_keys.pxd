# Signature keys and the route cache: the C-level API of pxrt/_keys.pyx.

cdef object signature_of(object request)


cdef class RouteCache:
    cdef readonly Py_ssize_t maxsize
    cdef dict _entries

    cpdef object get(self, object key)
    cpdef put(self, object key, object route)
    cpdef clear(self)
