# cython: language_level=3
"""The per-step host work of generation, in one C loop per step.

A decode step samples one token for every slot; ``SlotTable.route`` hands each to the
generation that owned the slot when the step was dispatched (a snapshot: the slot may
have been freed and reassigned since), checks its stop conditions, frees the slots of
the generations that finished, and lists the generations to wake. ``pxrt._slots_py`` is
the pure-Python twin; tests hold the two to each other.
"""

cimport numpy as cnp
from cpython.list cimport PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject

cnp.import_array()

STOP = "stop"
LENGTH = "length"
CANCELLED = "cancelled"
ERROR = "error"


cdef class Generation:
    """One request's generation state as the host loop sees it: the tokens so far and
    what ends it. ``pxrt.generate.Generation`` adds waiting and iteration."""

    def __init__(self, Py_ssize_t max_tokens, frozenset stop_ids):
        self.tokens = []
        self.max_tokens = max_tokens
        self.stop_ids = stop_ids
        self.finish_reason = None
        self.slot = -1
        self.dispatched = 0
        self.woken = False
        self.t_first = 0.0
        self.t_last = 0.0


cdef class SlotTable:
    """Which generation owns each decode slot, and the free slots."""

    def __init__(self, Py_ssize_t slots):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.owners = [None] * slots
        # Popped from the end: slot 0 is taken first.
        self.free = list(range(slots - 1, -1, -1))
        self.busy = 0

    cpdef Py_ssize_t assign(self, Generation gen, Py_ssize_t slot=-1) except -1:
        """Give ``gen`` a free slot for its prefill (which computes its first token);
        returns it (the caller checked one is free). ``slot``: the one the caller took
        from ``free`` earlier (to fill it over several programs before it joins the
        steps). A generation of one token gives the slot back at once: no step will
        compute for it."""
        if gen is None:
            raise TypeError("assign() needs a Generation, not None")
        if slot < 0:
            slot = self.free.pop()
        self.owners[slot] = gen
        gen.slot = slot
        gen.dispatched = 1
        self.busy += 1
        if gen.max_tokens <= 1:
            self._vacate(slot)
        return slot

    cpdef release(self, Generation gen):
        """Free ``gen``'s slot if it still holds one."""
        if gen is None:
            raise TypeError("release() needs a Generation, not None")
        cdef Py_ssize_t slot = gen.slot
        if slot >= 0 and self.owners[slot] is gen:
            self.owners[slot] = None
            self.free.append(slot)
            self.busy -= 1
        gen.slot = -1

    cdef inline void _vacate(self, Py_ssize_t slot) except *:
        self.owners[slot] = None
        self.free.append(slot)
        self.busy -= 1

    def dispatch(self, Py_ssize_t steps=1):
        """A step (or a block of ``steps``) is being dispatched: the owners as it sees
        them (its tokens go to them). A generation whose last token (``max_tokens``)
        it computes gives its slot back now, so that a prompt can be inserted before
        the next step."""
        cdef list owners = list(self.owners)
        cdef Py_ssize_t i, n = PyList_GET_SIZE(owners)
        cdef Generation gen
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        for i in range(n):
            item = <object>PyList_GET_ITEM(owners, i)
            if item is None:
                continue
            gen = <Generation?>item
            gen.dispatched += steps
            if gen.dispatched >= gen.max_tokens:
                self._vacate(i)
        return owners

    def route(self, cnp.ndarray tokens, list owners, double now, list woken, list finished):
        """Route one step's sampled tokens (int32, one per slot) to ``owners`` (the
        step's snapshot): generations that got a token go to ``woken`` (once each until
        their ``woken`` flag is cleared), those that ended to ``finished`` too. Returns
        the number of tokens routed."""
        cdef const int[::1] toks = _int32s(tokens)
        cdef Py_ssize_t i, routed = 0, n = PyList_GET_SIZE(owners)
        cdef Generation gen
        if toks.shape[0] < n:
            raise ValueError(f"{toks.shape[0]} tokens for {n} slots")
        for i in range(n):
            item = <object>PyList_GET_ITEM(owners, i)
            if item is None:
                continue
            gen = <Generation?>item
            if gen.finish_reason is None:
                self._emit(gen, toks[i], now, woken, finished)
                routed += 1
        return routed

    def first(self, cnp.ndarray tokens, list gens, double now, list woken, list finished):
        """Route a prefill's first tokens: row i belongs to ``gens[i]`` (None: to no
        one). Returns the number of tokens routed."""
        cdef const int[::1] toks = _int32s(tokens)
        cdef Py_ssize_t i, routed = 0, n = PyList_GET_SIZE(gens)
        cdef Generation gen
        cdef object item
        if toks.shape[0] < n:
            raise ValueError(f"{toks.shape[0]} tokens for {n} generations")
        for i in range(n):
            item = <object>PyList_GET_ITEM(gens, i)
            if item is None:
                continue
            gen = <Generation?>item
            if gen.finish_reason is None:
                gen.t_first = now
                self._emit(gen, toks[i], now, woken, finished)
                routed += 1
        return routed

    cdef inline void _emit(
        self, Generation gen, int token, double now, list woken, list finished
    ) except *:
        cdef object tok = token
        PyList_Append(gen.tokens, tok)
        gen.t_last = now
        if tok in gen.stop_ids:
            gen.finish_reason = STOP
        elif PyList_GET_SIZE(gen.tokens) >= gen.max_tokens:
            gen.finish_reason = LENGTH
        if gen.finish_reason is not None:
            self.release(gen)
            PyList_Append(finished, gen)
        if not gen.woken:
            gen.woken = True
            PyList_Append(woken, gen)


cdef const int[::1] _int32s(cnp.ndarray tokens) except *:
    if tokens.dtype.num != cnp.NPY_INT32 or tokens.ndim != 1:
        raise TypeError(f"tokens must be a 1-D int32 array, got {tokens.dtype}{(<object>tokens).shape}")
    if not cnp.PyArray_IS_C_CONTIGUOUS(tokens):
        # (a row of a block's tokens read from an accelerator can be strided: the TPU's
        # host copy of a [steps, rows] array comes back column-major)
        tokens = cnp.PyArray_GETCONTIGUOUS(tokens)
    return tokens
