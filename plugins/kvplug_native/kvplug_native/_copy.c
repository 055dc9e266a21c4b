/* kvplug_native._copy: copy a table of byte runs with the GIL released.
 *
 * A run table is `count` rows of three int64: destination address, source address,
 * bytes. The Python side (kvplug_native.runs) builds it from torch tensors it has
 * checked (every run lies inside a tensor of the right size), so this file trusts it.
 *
 * What makes this faster than torch's index kernels on host memory:
 * - one call copies every run of a batch (thousands of 2-32 KiB runs), where torch
 *   needs a Python-dispatched op per chunk and layer;
 * - the runs are shared out among the calling thread's OpenMP team, the team torch's
 *   own CPU ops run on: the extension links libgomp.so.1, the runtime torch loads, so
 *   the dynamic loader hands both the same one. Right after an engine's ops that
 *   team's workers still spin on the cores; threads of our own would wait for them
 *   (on a 2-core VM a copy on two threads of its own right after a torch op ran at
 *   60% of its speed a moment later);
 * - with `streaming`, runs are written with non-temporal stores (x86-64 SSE2): the
 *   destination lines are not read before they are overwritten, so a copy moves two
 *   bytes of memory traffic per byte instead of three. Batches far larger than the CPU
 *   caches (a prompt's KV) gain most; small ones keep memcpy, whose writes stay in
 *   cache for the reader that follows.
 * Sources of short runs that do not follow the previous run are prefetched a few runs
 * ahead: gathers out of a paged cache read small runs from scattered addresses.
 */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#define KVPLUG_OPENMP 1
#else
#define KVPLUG_OPENMP 0
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KVPLUG_STREAMING 1
#else
#define KVPLUG_STREAMING 0
#endif

typedef struct {
    int64_t dst;
    int64_t src;
    int64_t nbytes;
} kvplug_run;

/* How many runs ahead a scattered source is prefetched, and up to how many bytes of it. */
#define PREFETCH_AHEAD 4
#define PREFETCH_MAX_BYTES 4096

static void prefetch_source(const kvplug_run *runs, Py_ssize_t i, Py_ssize_t count) {
#if KVPLUG_STREAMING
    Py_ssize_t ahead = i + PREFETCH_AHEAD;
    if (ahead >= count) {
        return;
    }
    const kvplug_run *next = &runs[ahead];
    const kvplug_run *before = &runs[ahead - 1];
    /* A source that continues the run before it is streamed in by the hardware prefetcher. */
    if (next->nbytes > PREFETCH_MAX_BYTES || next->src == before->src + before->nbytes) {
        return;
    }
    const char *source = (const char *)(uintptr_t)next->src;
    for (int64_t offset = 0; offset < next->nbytes; offset += 64) {
        _mm_prefetch(source + offset, _MM_HINT_T0);
    }
#else
    (void)runs;
    (void)i;
    (void)count;
#endif
}

#if KVPLUG_STREAMING
static void copy_streaming(char *dst, const char *src, size_t nbytes) {
    /* Non-temporal stores need 16-byte aligned destinations: the unaligned head and the
       tail shorter than one 64-byte step go through memcpy. */
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > nbytes) {
        head = nbytes;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    nbytes -= head;
    size_t body = nbytes & ~(size_t)63;
    for (size_t offset = 0; offset < body; offset += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + offset));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + offset + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + offset + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + offset + 48));
        _mm_stream_si128((__m128i *)(dst + offset), a);
        _mm_stream_si128((__m128i *)(dst + offset + 16), b);
        _mm_stream_si128((__m128i *)(dst + offset + 32), c);
        _mm_stream_si128((__m128i *)(dst + offset + 48), d);
    }
    memcpy(dst + body, src + body, nbytes - body);
}
#endif

static void copy_one(const kvplug_run *runs, Py_ssize_t i, Py_ssize_t count, int streaming) {
    prefetch_source(runs, i, count);
    char *dst = (char *)(uintptr_t)runs[i].dst;
    const char *src = (const char *)(uintptr_t)runs[i].src;
    size_t nbytes = (size_t)runs[i].nbytes;
#if KVPLUG_STREAMING
    if (streaming) {
        copy_streaming(dst, src, nbytes);
        return;
    }
#else
    (void)streaming;
#endif
    memcpy(dst, src, nbytes);
}

static void copy_table(const kvplug_run *runs, Py_ssize_t count, int streaming, int threads) {
#if KVPLUG_OPENMP
    if (threads > 1 && count > 1) {
        /* guided: large shares first, smaller ones last, so runs of unequal sizes balance */
#pragma omp parallel for num_threads(threads) schedule(guided)
        for (Py_ssize_t i = 0; i < count; i++) {
            copy_one(runs, i, count, streaming);
        }
    } else
#else
    (void)threads;
#endif
    {
        for (Py_ssize_t i = 0; i < count; i++) {
            copy_one(runs, i, count, streaming);
        }
    }
#if KVPLUG_STREAMING
    if (streaming) {
        _mm_sfence(); /* the streamed stores are visible to other threads once this returns */
    }
#endif
}

static PyObject *copy_runs(PyObject *module, PyObject *args) {
    (void)module;
    unsigned long long table;
    Py_ssize_t count;
    int streaming;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "Knp|i:copy_runs", &table, &count, &streaming, &threads)) {
        return NULL;
    }
    if (count < 0 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "copy_runs: count must not be negative and threads must be at least 1");
        return NULL;
    }
    if (count > 0 && table == 0) {
        PyErr_SetString(PyExc_ValueError, "copy_runs: the table address is 0");
        return NULL;
    }
    const kvplug_run *runs = (const kvplug_run *)(uintptr_t)table;
    Py_BEGIN_ALLOW_THREADS
    copy_table(runs, count, streaming, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_runs", copy_runs, METH_VARARGS,
     "copy_runs(table, count, streaming, threads=1, /)\n--\n\n"
     "Copy `count` runs of the int64 table at address `table` (rows: destination address,\n"
     "source address, bytes), releasing the GIL. `streaming` writes with non-temporal stores\n"
     "where the CPU has them (STREAMING_STORES); `threads` share the runs out among the calling\n"
     "thread's OpenMP team where the extension was built with OpenMP (OPENMP)."},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject *module) {
    if (PyModule_AddIntConstant(module, "STREAMING_STORES", KVPLUG_STREAMING) < 0) {
        return -1;
    }
    return PyModule_AddIntConstant(module, "OPENMP", KVPLUG_OPENMP);
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvplug_native._copy", "Copies of byte-run tables with the GIL released.", 0,
    methods, slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__copy(void) { return PyModuleDef_Init(&module_def); }
