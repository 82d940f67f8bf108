cdef class Generation:
    cdef object __weakref__
    cdef public list tokens
    cdef public Py_ssize_t max_tokens
    cdef public frozenset stop_ids
    cdef public object finish_reason
    cdef public Py_ssize_t slot
    cdef public Py_ssize_t dispatched
    cdef public bint woken
    cdef public double t_first
    cdef public double t_last


cdef class SlotTable:
    cdef readonly Py_ssize_t slots
    cdef public list owners
    cdef public list free
    cdef public Py_ssize_t busy

    cpdef Py_ssize_t assign(self, Generation gen, Py_ssize_t slot=*) except -1
    cpdef release(self, Generation gen)
    cdef inline void _vacate(self, Py_ssize_t slot) except *
    cdef inline void _emit(
        self, Generation gen, int token, double now, list woken, list finished
    ) except *
