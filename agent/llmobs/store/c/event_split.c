/* The store's ingest decoder in one pass (llmobs/store/ingest.py, EventDecoder): ring records
 * (EVENT_DTYPE, 64 bytes each) split by destination table straight into that table's column arrays.
 * A CPython extension module, stable ABI (3.11+), built at install by setup.py as
 * llmobs.store._event_split; without a compiler ingest.py decodes with numpy, to the same columns.
 *
 * Why C: numpy decodes by whole-array steps (transpose the records into a word matrix, sort it by
 * table, slice and copy each field), three copies of every record and ~64 ns an event on this
 * project's VMs, a sixth of the ingest path; the fresh pages of those copies were a good part of the
 * kernel time of a cold writer. Here each record is read once and each field written once, with the
 * GIL released.
 *
 * counts(parts, table_of_kind) -> tuple of TABLES ints: how many records of `parts` go to each table.
 * split(parts, table_of_kind, columns) -> None: fills columns[t][c] (t a table, c a column of COLUMNS)
 * with the records of table t, in their order in `parts`.
 *
 * `parts` is a sequence of C-contiguous buffers of whole records; `table_of_kind` 256 bytes, the
 * table index of each kind byte; each columns[t][c] a writable C-contiguous buffer of at least
 * counts[t] items of COLUMNS[c]'s size. Every size is checked before a byte is written. `layout()`
 * gives the record fields this file reads, (name, offset, size): ingest.py uses this module only if
 * they equal EVENT_DTYPE's.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define RECORD_BYTES 64
#define TABLES 3
#define MAX_PARTS 4096

/* struct llmobs_event (bpf/c/llmobs_events.h) as the ring hands it: little-endian, packed by layout */
typedef struct {
  uint32_t pid, tid, cpu;
  uint16_t probe;
  uint8_t kind, flags;
  uint64_t ts_ns, step_seq, trace_id_hi, trace_id_lo, value, duration_ns;
} record;

_Static_assert(sizeof(record) == RECORD_BYTES, "record layout");

/* The output columns, in the order `split` takes them, and each one's item size. */
enum { PID, TID, CPU, TS_NS, STEP_SEQ, TRACE_HI, TRACE_LO, VALUE, DURATION_NS, PROBE, KIND, COLUMNS };
static const char *const column_names[COLUMNS] = {"pid",      "tid",   "cpu",         "ts_ns", "step_seq", "trace_hi",
                                                  "trace_lo", "value", "duration_ns", "probe", "kind"};
static const Py_ssize_t column_sizes[COLUMNS] = {4, 4, 2, 8, 8, 8, 8, 8, 8, 2, 1};

typedef struct {
  Py_buffer views[MAX_PARTS];
  Py_ssize_t count;
} parts_view;

static void release_parts(parts_view *parts) {
  for (Py_ssize_t i = 0; i < parts->count; i++) PyBuffer_Release(&parts->views[i]);
  parts->count = 0;
}

static int open_parts(PyObject *seq, parts_view *parts) {
  parts->count = 0;
  PyObject *items = PySequence_Tuple(seq);
  if (!items) return -1;
  Py_ssize_t n = PyTuple_Size(items);
  if (n > MAX_PARTS) {
    Py_DECREF(items);
    PyErr_Format(PyExc_ValueError, "at most %d parts in one call", MAX_PARTS);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    Py_buffer *view = &parts->views[i];
    if (PyObject_GetBuffer(PyTuple_GetItem(items, i), view, PyBUF_C_CONTIGUOUS) < 0) goto fail;
    parts->count = i + 1;
    if (view->len % RECORD_BYTES) {
      PyErr_Format(PyExc_ValueError, "part %zd is %zd bytes, not whole %d-byte records", i, view->len, RECORD_BYTES);
      goto fail;
    }
  }
  Py_DECREF(items);
  return 0;
fail:
  Py_DECREF(items);
  release_parts(parts);
  return -1;
}

static int open_table_of_kind(PyObject *obj, Py_buffer *view) {
  if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
  const uint8_t *table = view->buf;
  if (view->len != 256) {
    PyBuffer_Release(view);
    PyErr_SetString(PyExc_ValueError, "table_of_kind must be 256 bytes");
    return -1;
  }
  for (int k = 0; k < 256; k++) {
    if (table[k] >= TABLES) {
      PyBuffer_Release(view);
      PyErr_Format(PyExc_ValueError, "table_of_kind[%d] = %d: there are %d tables", k, table[k], TABLES);
      return -1;
    }
  }
  return 0;
}

static void count_records(const parts_view *parts, const uint8_t *table_of_kind, Py_ssize_t counts[TABLES]) {
  for (int t = 0; t < TABLES; t++) counts[t] = 0;
  for (Py_ssize_t p = 0; p < parts->count; p++) {
    const record *rec = parts->views[p].buf;
    Py_ssize_t n = parts->views[p].len / RECORD_BYTES;
    for (Py_ssize_t i = 0; i < n; i++) counts[table_of_kind[rec[i].kind]]++;
  }
}

/* `parts` and `table_of_kind` opened together: on failure nothing stays open. */
static int open_inputs(PyObject *const *args, parts_view *parts, Py_buffer *kinds) {
  if (open_parts(args[0], parts) < 0) return -1;
  if (open_table_of_kind(args[1], kinds) < 0) {
    release_parts(parts);
    return -1;
  }
  return 0;
}

static void release_inputs(parts_view *parts, Py_buffer *kinds) {
  PyBuffer_Release(kinds);
  release_parts(parts);
}

static PyObject *py_counts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "counts(parts, table_of_kind)");
    return NULL;
  }
  parts_view *parts = PyMem_Malloc(sizeof(parts_view));
  if (!parts) return PyErr_NoMemory();
  Py_buffer kinds;
  Py_ssize_t counts[TABLES];
  PyObject *result = NULL;
  if (open_inputs(args, parts, &kinds) == 0) {
    Py_BEGIN_ALLOW_THREADS
    count_records(parts, kinds.buf, counts);
    Py_END_ALLOW_THREADS
    release_inputs(parts, &kinds);
    result = Py_BuildValue("(nnn)", counts[0], counts[1], counts[2]);
  }
  PyMem_Free(parts);
  return result;
}

typedef struct {
  Py_buffer views[TABLES][COLUMNS];
  int opened[TABLES][COLUMNS];
} columns_view;

static void release_columns(columns_view *cols) {
  for (int t = 0; t < TABLES; t++)
    for (int c = 0; c < COLUMNS; c++)
      if (cols->opened[t][c]) PyBuffer_Release(&cols->views[t][c]);
}

static int open_columns(PyObject *obj, const Py_ssize_t counts[TABLES], columns_view *cols) {
  memset(cols->opened, 0, sizeof(cols->opened));
  if (!PyTuple_Check(obj) || PyTuple_Size(obj) != TABLES) {
    PyErr_Format(PyExc_TypeError, "columns must be a tuple of %d tuples (one a table)", TABLES);
    return -1;
  }
  for (int t = 0; t < TABLES; t++) {
    PyObject *table = PyTuple_GetItem(obj, t);
    if (!PyTuple_Check(table) || PyTuple_Size(table) != COLUMNS) {
      PyErr_Format(PyExc_TypeError, "columns[%d] must be a tuple of %d buffers", t, COLUMNS);
      goto fail;
    }
    for (int c = 0; c < COLUMNS; c++) {
      Py_buffer *view = &cols->views[t][c];
      if (PyObject_GetBuffer(PyTuple_GetItem(table, c), view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto fail;
      cols->opened[t][c] = 1;
      if (view->len < counts[t] * column_sizes[c]) {
        PyErr_Format(PyExc_ValueError, "columns[%d] (%s): %zd bytes, %zd needed", t, column_names[c], view->len,
                     counts[t] * column_sizes[c]);
        goto fail;
      }
    }
  }
  return 0;
fail:
  release_columns(cols);
  return -1;
}

/* Each table's columns as typed pointers, advanced as its rows are written. */
typedef struct {
  int32_t *pid, *tid;
  int16_t *cpu;
  int64_t *ts_ns, *step_seq;
  uint64_t *trace_hi, *trace_lo;
  int64_t *value, *duration_ns;
  int16_t *probe;
  int8_t *kind;
} table_out;

static void split_records(const parts_view *parts, const uint8_t *table_of_kind, columns_view *cols) {
  table_out out[TABLES];
  for (int t = 0; t < TABLES; t++) {
    Py_buffer *v = cols->views[t];
    out[t] = (table_out){v[PID].buf,      v[TID].buf,   v[CPU].buf,         v[TS_NS].buf, v[STEP_SEQ].buf, v[TRACE_HI].buf,
                         v[TRACE_LO].buf, v[VALUE].buf, v[DURATION_NS].buf, v[PROBE].buf, v[KIND].buf};
  }
  Py_ssize_t row[TABLES] = {0};
  for (Py_ssize_t p = 0; p < parts->count; p++) {
    const record *rec = parts->views[p].buf;
    Py_ssize_t n = parts->views[p].len / RECORD_BYTES;
    for (Py_ssize_t i = 0; i < n; i++, rec++) {
      int t = table_of_kind[rec->kind];
      table_out *o = &out[t];
      Py_ssize_t r = row[t]++;
      /* the same conversions as the numpy path: views for same-size fields, cpu truncated to 16 bits */
      o->pid[r] = (int32_t)rec->pid;
      o->tid[r] = (int32_t)rec->tid;
      o->cpu[r] = (int16_t)rec->cpu;
      o->ts_ns[r] = (int64_t)rec->ts_ns;
      o->step_seq[r] = (int64_t)rec->step_seq;
      o->trace_hi[r] = rec->trace_id_hi;
      o->trace_lo[r] = rec->trace_id_lo;
      o->value[r] = (int64_t)rec->value;
      o->duration_ns[r] = (int64_t)rec->duration_ns;
      o->probe[r] = (int16_t)rec->probe;
      o->kind[r] = (int8_t)rec->kind;
    }
  }
}

static PyObject *py_split(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "split(parts, table_of_kind, columns)");
    return NULL;
  }
  parts_view *parts = PyMem_Malloc(sizeof(parts_view));
  columns_view *cols = PyMem_Malloc(sizeof(columns_view));
  Py_buffer kinds;
  Py_ssize_t counts[TABLES];
  PyObject *result = NULL;
  if (!parts || !cols) {
    PyErr_NoMemory();
    goto done;
  }
  if (open_inputs(args, parts, &kinds) < 0) goto done;
  count_records(parts, kinds.buf, counts);
  if (open_columns(args[2], counts, cols) == 0) {
    Py_BEGIN_ALLOW_THREADS
    split_records(parts, kinds.buf, cols);
    Py_END_ALLOW_THREADS
    release_columns(cols);
    result = Py_NewRef(Py_None);
  }
  release_inputs(parts, &kinds);
done:
  PyMem_Free(parts);
  PyMem_Free(cols);
  return result;
}

static PyObject *py_layout(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
#define FIELD(name) #name, (Py_ssize_t)offsetof(record, name), (Py_ssize_t)sizeof(((record *)0)->name)
  return Py_BuildValue("((snn)(snn)(snn)(snn)(snn)(snn)(snn)(snn)(snn)(snn)(snn)(snn))", FIELD(pid), FIELD(tid),
                       FIELD(cpu), FIELD(probe), FIELD(kind), FIELD(flags), FIELD(ts_ns), FIELD(step_seq),
                       FIELD(trace_id_hi), FIELD(trace_id_lo), FIELD(value), FIELD(duration_ns));
#undef FIELD
}

static PyMethodDef methods[] = {
    {"counts", (PyCFunction)(void (*)(void))py_counts, METH_FASTCALL,
     "counts(parts, table_of_kind) -> records of parts per table"},
    {"split", (PyCFunction)(void (*)(void))py_split, METH_FASTCALL,
     "split(parts, table_of_kind, columns): fill each table's columns from parts"},
    {"layout", py_layout, METH_NOARGS, "layout() -> the record fields read: (name, offset, size)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_event_split", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__event_split(void) { return PyModule_Create(&module); }
