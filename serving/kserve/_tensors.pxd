# Strict JSON tensor data: the C-level API of serving/kserve/_tensors.pyx.

# What a tensor's JSON elements must be, and what they are stored as while checked.
cdef enum Kind:
    KIND_BOOL = 0      # JSON true/false               -> uint8
    KIND_INT = 1       # JSON integers, signed range    -> int64
    KIND_UINT = 2      # JSON integers, unsigned range  -> uint64
    KIND_FLOAT = 3     # JSON numbers (not booleans)    -> float64

# The range a tensor's values must be in: integers low..high, floats below fmax in
# magnitude (the threshold above which they would round to infinity).
ctypedef struct Range:
    long long low
    unsigned long long high
    double fmax

cdef Py_ssize_t _fill(object data, const Py_ssize_t* dims, int ndim, int depth, int kind,
                      char* out, Py_ssize_t at, const Range* bounds) except -1
