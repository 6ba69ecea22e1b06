/* OTEP 4947 thread context for llmobs: the TLS symbol otel_thread_ctx_v1 in .dynsym and the few calls
 * the Python publisher makes through ctypes (llmobs/shm/thread_ctx.py). Built at install by setup.py
 * (build_ext: `pip install .`, and the editable install scripts/setup.sh makes), in effect:
 *
 *   gcc -O2 -fPIC -shared -mtls-dialect=gnu2 -o libllmobs_otel_thread_ctx.so otel_thread_ctx.c
 *
 * -mtls-dialect=gnu2: TLSDESC, the model the OTEP recommends to writers. The TLS pointer of each thread
 * is set once, to that thread's own record, and never changed; updates flip `valid` (the OTEP's
 * "fixed record" writer): valid = 0, fields, valid = 1, with compiler fences in between. The OTEP's
 * concurrency model is a signal handler's: a reader only reads a thread that is stopped (a perf event,
 * a uprobe), so the CPU cannot reorder what the thread itself sees; only the compiler must not.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define RECORD_BYTES 640 /* the OTEP's recommended maximum (the eBPF profiler's read limit) */
#define HEAD_BYTES 28
#define ATTRS_BYTES (RECORD_BYTES - HEAD_BYTES)

/* The Thread-Local Context Record: byte-packed, native byte order, at least 2-byte aligned. */
struct __attribute__((packed, aligned(8))) otel_thread_ctx_record {
  uint8_t trace_id[16]; /* W3C bytes; zero: no trace */
  uint8_t span_id[8];
  uint8_t valid;        /* 1: readable; anything else: ignore the record */
  uint8_t trace_flags;
  uint16_t attrs_data_size;
  uint8_t attrs_data[ATTRS_BYTES]; /* entries: key index u8, length u8, value bytes */
};

_Static_assert(sizeof(struct otel_thread_ctx_record) == RECORD_BYTES, "record is 640 bytes");
_Static_assert(__builtin_offsetof(struct otel_thread_ctx_record, attrs_data) == HEAD_BYTES, "head is 28");

__attribute__((visibility("default"))) __thread struct otel_thread_ctx_record *otel_thread_ctx_v1;
static __thread struct otel_thread_ctx_record record;

#define COMPILER_FENCE() atomic_signal_fence(memory_order_seq_cst)

/* llmobs's own probes find a thread's record here, by tid, without resolving TLS (which needs the
 * thread's fs_base, a kernel-struct read whose layout the agent's compile-time headers may not match,
 * and glibc's DTV): slot tid % 1024 holds (tid, record address) while that thread lives. Two live
 * threads in one slot: the later one wins, the other's events are tagged from the process cell. The
 * agent reads the symbol's address from this library's .dynsym (docs/shm-abi.md). */
#define REGISTRY_SLOTS 1024
struct llmobs_thread_slot {
  uint32_t tid;
  uint32_t pad;
  uint64_t record;
};
__attribute__((visibility("default"))) struct llmobs_thread_slot llmobs_thread_ctx_registry[REGISTRY_SLOTS];
static __thread uint32_t registered_tid;
static pthread_key_t exit_key;
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;

static void unregister(void *unused) {
  (void)unused;
  struct llmobs_thread_slot *slot = &llmobs_thread_ctx_registry[registered_tid % REGISTRY_SLOTS];
  if (slot->tid == registered_tid) *(volatile uint32_t *)&slot->tid = 0; /* before the TLS is freed */
  registered_tid = 0;
}

static void forget_after_fork(void) { /* the child's threads have other tids; its one thread re-registers */
  memset(llmobs_thread_ctx_registry, 0, sizeof llmobs_thread_ctx_registry);
  registered_tid = 0;
}

static void make_exit_key(void) {
  pthread_key_create(&exit_key, unregister);
  pthread_atfork(NULL, NULL, forget_after_fork);
}

static void register_thread(struct otel_thread_ctx_record *r) {
  uint32_t tid = (uint32_t)syscall(SYS_gettid);
  struct llmobs_thread_slot *slot = &llmobs_thread_ctx_registry[tid % REGISTRY_SLOTS];
  pthread_once(&exit_once, make_exit_key);
  pthread_setspecific(exit_key, (void *)1); /* non-NULL: the destructor runs at this thread's exit */
  *(volatile uint32_t *)&slot->tid = 0;
  COMPILER_FENCE();
  slot->record = (uint64_t)(uintptr_t)r;
  COMPILER_FENCE();
  *(volatile uint32_t *)&slot->tid = tid;
  registered_tid = tid;
}

/* ids: trace id (16 bytes) then span id (8 bytes); attrs: attrs_len bytes of encoded entries. */
void llmobs_thread_ctx_attach(const uint8_t *ids, uint32_t trace_flags, const uint8_t *attrs,
                              uint32_t attrs_len) {
  struct otel_thread_ctx_record *r = &record;
  if (attrs_len > ATTRS_BYTES) attrs_len = 0; /* the caller keeps entries short; never truncate one */
  *(volatile uint8_t *)&r->valid = 0;
  COMPILER_FENCE();
  memcpy(r->trace_id, ids, 24);
  r->trace_flags = (uint8_t)trace_flags;
  if (attrs_len) memcpy(r->attrs_data, attrs, attrs_len);
  r->attrs_data_size = (uint16_t)attrs_len;
  COMPILER_FENCE();
  *(volatile uint8_t *)&r->valid = 1;
  if (otel_thread_ctx_v1 != r) {
    COMPILER_FENCE();
    *(struct otel_thread_ctx_record *volatile *)&otel_thread_ctx_v1 = r; /* once per thread */
  }
  if (!registered_tid) register_thread(r);
}

void llmobs_thread_ctx_detach(void) {
  *(volatile uint8_t *)&record.valid = 0;
  COMPILER_FENCE();
}

/* --- the span id of a token step, computed here so a step costs one call ------------------------
 * llmobs.otlp.encoder.SpanIds.step_span_id: BLAKE2b-64 (c/blake2b_64.h) of
 * "step\x1f<pid>\x1f<trace hex>\x1f<step_seq>\x1f<batch row>", all-zero replaced by 01 00.. (OTLP).
 * The unit tests hold this against hashlib and the encoder. */
#include "blake2b_64.h"

/* BLAKE2b with an 8-byte digest of text[0..len): exported for thread_ctx.py's tests. */
void llmobs_blake2b_64(const uint8_t *text, uint32_t len, uint8_t out[8]) { blake2b_64(text, len, out); }

/* One token step on this thread. blob (prepared once per trace and tenant by thread_ctx.py):
 *   [0] prefix length P (0: no trace), [1] tenant entry length E, [2..18) trace id,
 *   [18..18+P) "step\x1f<pid>\x1f<trace hex>\x1f", then E bytes: the tenant's attrs-data entry.
 * The record gets the trace id, the span id of (pid, trace, step_seq, batch row 0), the step_seq
 * entry (key 1, decimal) and the tenant entry. */
void llmobs_thread_ctx_step(const uint8_t *blob, uint32_t seq_lo, uint32_t seq_hi) {
  uint8_t ids[24], attrs[2 + 255 + 2 + 20], text[256 + 24], digits[20];
  uint32_t prefix = blob[0], tenant = blob[1], n = 0, a = 0;
  uint64_t seq = ((uint64_t)seq_hi << 32) | seq_lo;
  do digits[n++] = (uint8_t)('0' + seq % 10), seq /= 10; while (seq);
  uint32_t flags = 0;
  if (prefix) {
    uint32_t len = prefix;
    memcpy(text, blob + 18, prefix);
    for (uint32_t i = 0; i < n; i++) text[len++] = digits[n - 1 - i];
    text[len++] = 0x1f;
    text[len++] = '0';
    memcpy(ids, blob + 2, 16);
    llmobs_blake2b_64(text, len, ids + 16);
    static const uint8_t zero[8];
    if (!memcmp(ids + 16, zero, 8)) ids[16] = 1;
    flags = 1; /* sampled */
  } else {
    memset(ids, 0, sizeof ids);
  }
  /* step_seq first, at a fixed place (attrs-data offset 0): llmobs's probes read it with the head */
  attrs[a++] = 1; /* key 1: llmobs.step_seq */
  attrs[a++] = (uint8_t)n;
  for (uint32_t i = 0; i < n; i++) attrs[a++] = digits[n - 1 - i];
  memcpy(attrs + a, blob + 18 + prefix, tenant);
  a += tenant;
  llmobs_thread_ctx_attach(ids, flags, attrs, a);
}

/* This thread's record and TLS pointer (tests and the reader's checks). */
uintptr_t llmobs_thread_ctx_record_address(void) { return (uintptr_t)&record; }
uintptr_t llmobs_thread_ctx_pointer(void) { return (uintptr_t)otel_thread_ctx_v1; }

/* A full barrier for OTEP 4719's publication and update protocols (atomic_thread_fence(seq_cst)):
 * Python has none of its own. */
void llmobs_otel_fence(void) { atomic_thread_fence(memory_order_seq_cst); }

/* What the ctypes side checks before using the calls above. */
uint32_t llmobs_thread_ctx_abi(void) { return 3; }

#ifdef LLMOBS_PYTHON_EXTENSION
/* The same calls as a CPython extension module (stable ABI, 3.11+): a METH_FASTCALL call costs a
 * fraction of a ctypes call, and the per-step call is the one that counts. setup.py adds this
 * part when the interpreter's headers are there; thread_ctx.py uses ctypes when it is not. */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *py_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  char *blob;
  Py_ssize_t size;
  if (nargs != 2 || PyBytes_AsStringAndSize(args[0], &blob, &size) < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "step(blob: bytes, step_seq: int)");
    return NULL;
  }
  unsigned long long seq = PyLong_AsUnsignedLongLong(args[1]);
  if (seq == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
  const uint8_t *b = (const uint8_t *)blob;
  if (size < 18 || size < 18 + (Py_ssize_t)b[0] + (Py_ssize_t)b[1]) {
    PyErr_SetString(PyExc_ValueError, "blob too short for its lengths");
    return NULL;
  }
  llmobs_thread_ctx_step(b, (uint32_t)seq, (uint32_t)(seq >> 32));
  Py_RETURN_NONE;
}

static PyObject *py_detach(PyObject *self, PyObject *unused) {
  (void)self, (void)unused;
  llmobs_thread_ctx_detach();
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"step", (PyCFunction)(void (*)(void))py_step, METH_FASTCALL, "step(blob, step_seq): this thread's record"},
    {"detach", py_detach, METH_NOARGS, "detach(): this thread's record reads invalid"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_llmobs_otel_thread_ctx", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__llmobs_otel_thread_ctx(void) { return PyModule_Create(&module); }
#endif
