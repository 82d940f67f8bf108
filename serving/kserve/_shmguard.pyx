# cython: language_level=3
"""Client shared memory that a client cannot crash the server with: the mappings of
registered regions, guarded against SIGBUS (``serving.kserve.shm``).

A client that shrinks (``ftruncate``) its segment while the server reads or writes a
mapping of it makes that access fault: SIGBUS, which kills the process. Checking the
size first cannot help (the client shrinks it between the check and the access). So
``protect(mapping)`` puts the mapping's addresses in a table that a SIGBUS handler
(installed with the first one) reads: a fault inside a protected mapping replaces the
whole mapping, in place, with anonymous zero pages (``mmap(MAP_FIXED)``, as Wayland
compositors do for their clients' buffers) and marks it ``broken``; the access then
completes, and so does every later one, on zeros. Whoever read or wrote it checks
``broken`` afterwards and refuses that request, and only that one. A fault anywhere
else goes to the handler that was there before (or kills the process, as without us).

Nothing here costs anything until a fault: the reads are the mapping's own.
``_shmguard_py`` is the pure-Python twin, which cannot catch a signal: ``PROTECTS`` is
False there, and ``shm`` reads and writes through the segment's descriptor instead.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer

cdef extern from *:
    """
    #include <signal.h>
    #include <stdint.h>
    #include <string.h>
    #include <sys/mman.h>

    #ifndef MAP_ANONYMOUS
    #define MAP_ANONYMOUS MAP_ANON
    #endif

    #define PXRT_GUARD_SLOTS 4096

    /* One protected mapping: [start, end); start 0 is a free slot. Written with the
       GIL held (one writer), read by the handler on any thread. */
    typedef struct {
        uintptr_t start;
        uintptr_t end;
        int broken;
    } pxrt_guard_slot;

    static pxrt_guard_slot pxrt_guard_slots[PXRT_GUARD_SLOTS];
    static long pxrt_guard_faults;
    static int pxrt_guard_installed;
    static struct sigaction pxrt_guard_previous;
    static struct sigaction pxrt_guard_default;

    static void pxrt_guard_on_sigbus(int sig, siginfo_t *info, void *context) {
        uintptr_t at = (uintptr_t)info->si_addr;
        int i;
        if (info->si_code > 0) {  /* a fault (not a kill): whose address? */
            for (i = 0; i < PXRT_GUARD_SLOTS; i++) {
                uintptr_t start = __atomic_load_n(&pxrt_guard_slots[i].start, __ATOMIC_ACQUIRE);
                uintptr_t end = __atomic_load_n(&pxrt_guard_slots[i].end, __ATOMIC_ACQUIRE);
                if (start == 0 || at < start || at >= end) {
                    continue;
                }
                /* Zero pages where the segment was: the access completes (on zeros),
                   as every later one; the mapping stays the caller's to unmap. */
                if (mmap((void *)start, end - start, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED) {
                    break;
                }
                __atomic_store_n(&pxrt_guard_slots[i].broken, 1, __ATOMIC_RELEASE);
                __atomic_add_fetch(&pxrt_guard_faults, 1, __ATOMIC_RELEASE);
                return;
            }
        }
        /* Not ours: what would have happened without this handler. */
        if (pxrt_guard_previous.sa_flags & SA_SIGINFO) {
            pxrt_guard_previous.sa_sigaction(sig, info, context);
            return;
        }
        if (pxrt_guard_previous.sa_handler != SIG_DFL
                && pxrt_guard_previous.sa_handler != SIG_IGN) {
            pxrt_guard_previous.sa_handler(sig);
            return;
        }
        /* The default action: the faulting access runs again and ends the process
           (a signal sent by kill is sent again). */
        sigaction(SIGBUS, &pxrt_guard_default, NULL);
        if (info->si_code <= 0) {
            raise(sig);
        }
    }

    static int pxrt_guard_install(void) {
        struct sigaction ours;
        if (pxrt_guard_installed) {
            return 0;
        }
        memset(&ours, 0, sizeof ours);
        memset(&pxrt_guard_default, 0, sizeof pxrt_guard_default);
        pxrt_guard_default.sa_handler = SIG_DFL;
        sigemptyset(&pxrt_guard_default.sa_mask);
        ours.sa_sigaction = pxrt_guard_on_sigbus;
        ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&ours.sa_mask);
        if (sigaction(SIGBUS, &ours, &pxrt_guard_previous) != 0) {
            return -1;
        }
        pxrt_guard_installed = 1;
        return 0;
    }

    static int pxrt_guard_protect(uintptr_t start, uintptr_t end) {
        int i;
        for (i = 0; i < PXRT_GUARD_SLOTS; i++) {
            if (__atomic_load_n(&pxrt_guard_slots[i].start, __ATOMIC_ACQUIRE) == 0) {
                __atomic_store_n(&pxrt_guard_slots[i].broken, 0, __ATOMIC_RELEASE);
                __atomic_store_n(&pxrt_guard_slots[i].end, end, __ATOMIC_RELEASE);
                __atomic_store_n(&pxrt_guard_slots[i].start, start, __ATOMIC_RELEASE);
                return i;
            }
        }
        return -1;
    }

    static void pxrt_guard_release(int i) {
        __atomic_store_n(&pxrt_guard_slots[i].start, 0, __ATOMIC_RELEASE);
    }

    static int pxrt_guard_broken(int i) {
        return __atomic_load_n(&pxrt_guard_slots[i].broken, __ATOMIC_ACQUIRE);
    }

    static long pxrt_guard_fault_count(void) {
        return __atomic_load_n(&pxrt_guard_faults, __ATOMIC_ACQUIRE);
    }
    """
    int PXRT_GUARD_SLOTS
    int pxrt_guard_install()
    int pxrt_guard_protect(size_t start, size_t end)
    void pxrt_guard_release(int i)
    int pxrt_guard_broken(int i)
    long pxrt_guard_fault_count()

PROTECTS = True  # (the twin's is False)
SLOTS = PXRT_GUARD_SLOTS  # mappings protected at once


def protect(object mapping) -> int:
    """Guard ``mapping`` (an ``mmap.mmap`` of a client's segment: its addresses must
    stay mapped until ``release``); its slot, or -1 when ``SLOTS`` are taken."""
    cdef Py_buffer view
    if pxrt_guard_install() != 0:
        raise OSError("cannot install the SIGBUS handler that guards shared memory")
    PyObject_GetBuffer(mapping, &view, PyBUF_SIMPLE)
    cdef size_t start = <size_t>view.buf
    cdef size_t end = start + <size_t>view.len
    PyBuffer_Release(&view)
    return pxrt_guard_protect(start, end)


def release(int slot) -> None:
    """Stop guarding slot ``slot`` (its mapping is unmapped, or about to be)."""
    if 0 <= slot < PXRT_GUARD_SLOTS:
        pxrt_guard_release(slot)


def broken(int slot) -> bool:
    """Whether slot ``slot``'s mapping faulted (its segment shrank): zeros since."""
    return 0 <= slot < PXRT_GUARD_SLOTS and pxrt_guard_broken(slot) != 0


def faults() -> int:
    """How many mappings broke since the process started (0: no check is needed)."""
    return pxrt_guard_fault_count()
