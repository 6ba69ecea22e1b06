/* The one loop of the OTLP encoder that numpy cannot do in bulk: writing each row's byte segments back
 * to back (llmobs/otlp/wire.py, Pieces.gather). A CPython extension module, stable ABI (3.11+), built
 * at install by setup.py as llmobs.otlp._wire_gather; without a compiler wire.py gathers with numpy,
 * to the same bytes.
 *
 * Why C: numpy's gather lays every segment into a (rows x width) matrix, compresses it by a mask and
 * joins the wide parts row by row; for a batch of token-step spans (~240 segments a row) that was a
 * fifth of the exporter's CPU per span. Here it is one memcpy per non-empty (row, segment), with the
 * GIL released.
 *
 * gather(rows, total, segments) -> bytes: `segments` is a sequence of (data, start, length); `data` is
 * a uint8 buffer, 2-D (row i's bytes begin at data[i], its inner stride 1) or 1-D (row i's at
 * data[start[i]]); `start` (ignored for 2-D data) and `length` are int64 buffers of `rows` values. Every
 * read is bounds-checked against its buffer, and the lengths must add up to `total`: a mismatch raises
 * ValueError before a byte is written.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "blake2b_64.h"

typedef struct {
  Py_buffer data, start, length;
  int has_start;         /* 1-D data: rows begin at start[i] */
  Py_ssize_t row_stride; /* 2-D data: bytes between rows */
  Py_ssize_t limit;      /* 2-D: the row width; 1-D: the buffer's length */
} segment;

static void release(segment *segs, Py_ssize_t count) {
  for (Py_ssize_t k = 0; k < count; k++) {
    PyBuffer_Release(&segs[k].data);
    PyBuffer_Release(&segs[k].length);
    if (segs[k].has_start) PyBuffer_Release(&segs[k].start);
  }
}

/* An int64 vector of at least `rows` values, contiguous. */
static int int64_vector(PyObject *obj, Py_buffer *view, Py_ssize_t rows, const char *what) {
  if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
  if (view->itemsize != 8 || view->ndim != 1 || view->shape[0] < rows ||
      !(view->format[0] == 'q' || view->format[0] == 'l' || view->format[0] == 'Q')) {
    PyBuffer_Release(view);
    PyErr_Format(PyExc_ValueError, "segment %s: want %zd contiguous int64 values", what, rows);
    return -1;
  }
  return 0;
}

static int open_segment(PyObject *item, Py_ssize_t rows, segment *seg) {
  PyObject *data, *start, *length;
  if (!PyTuple_Check(item) || PyTuple_Size(item) != 3) {
    PyErr_SetString(PyExc_TypeError, "a segment is (data, start, length)");
    return -1;
  }
  data = PyTuple_GetItem(item, 0);
  start = PyTuple_GetItem(item, 1);
  length = PyTuple_GetItem(item, 2);
  if (PyObject_GetBuffer(data, &seg->data, PyBUF_STRIDES | PyBUF_FORMAT) < 0) return -1;
  Py_buffer *d = &seg->data;
  int two_d = d->ndim == 2;
  if (d->itemsize != 1 || (d->ndim != 1 && !two_d) || (two_d && d->shape[1] > 1 && d->strides[1] != 1) ||
      (!two_d && d->strides[0] != 1) || (two_d && d->shape[0] < rows)) {
    PyBuffer_Release(d);
    PyErr_SetString(PyExc_ValueError, "segment data: want uint8, 1-D contiguous or 2-D with rows of stride-1 bytes");
    return -1;
  }
  seg->has_start = !two_d;
  seg->row_stride = two_d ? d->strides[0] : 0;
  seg->limit = two_d ? d->shape[1] : d->shape[0];
  if (int64_vector(length, &seg->length, rows, "length") < 0) {
    PyBuffer_Release(d);
    return -1;
  }
  if (seg->has_start && int64_vector(start, &seg->start, rows, "start") < 0) {
    PyBuffer_Release(d);
    PyBuffer_Release(&seg->length);
    return -1;
  }
  return 0;
}

/* The bytes each row's segments need, checked against their buffers; -1 at the first bad one. */
static Py_ssize_t checked_total(const segment *segs, Py_ssize_t count, Py_ssize_t rows) {
  Py_ssize_t total = 0;
  for (Py_ssize_t k = 0; k < count; k++) {
    const int64_t *len = segs[k].length.buf;
    const int64_t *start = segs[k].has_start ? segs[k].start.buf : NULL;
    for (Py_ssize_t i = 0; i < rows; i++) {
      int64_t n = len[i];
      if (n < 0 || n > segs[k].limit) return -1;
      if (start && n && (start[i] < 0 || start[i] > segs[k].limit - n)) return -1;
      total += (Py_ssize_t)n;
    }
  }
  return total;
}

static PyObject *py_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "gather(rows, total, segments)");
    return NULL;
  }
  Py_ssize_t rows = PyLong_AsSsize_t(args[0]);
  Py_ssize_t total = PyLong_AsSsize_t(args[1]);
  if ((rows == -1 || total == -1) && PyErr_Occurred()) return NULL;
  if (rows < 0 || total < 0) {
    PyErr_SetString(PyExc_ValueError, "rows and total must be >= 0");
    return NULL;
  }
  PyObject *seq = PySequence_Tuple(args[2]);
  if (!seq) return NULL;
  Py_ssize_t count = PyTuple_Size(seq);
  segment *segs = PyMem_Calloc(count ? (size_t)count : 1, sizeof(segment));
  if (!segs) {
    Py_DECREF(seq);
    return PyErr_NoMemory();
  }
  Py_ssize_t opened = 0;
  PyObject *out = NULL;
  for (; opened < count; opened++)
    if (open_segment(PyTuple_GetItem(seq, opened), rows, &segs[opened]) < 0) goto done;
  if (checked_total(segs, count, rows) != total) {
    PyErr_SetString(PyExc_ValueError, "segment lengths out of their buffers or not adding up to total");
    goto done;
  }
  out = PyBytes_FromStringAndSize(NULL, total);
  if (!out) goto done;
  char *dst = PyBytes_AsString(out);
  Py_BEGIN_ALLOW_THREADS;
  for (Py_ssize_t i = 0; i < rows; i++) {
    for (Py_ssize_t k = 0; k < count; k++) {
      int64_t n = ((const int64_t *)segs[k].length.buf)[i];
      if (!n) continue;
      const char *src = segs[k].data.buf;
      src += segs[k].has_start ? (Py_ssize_t)((const int64_t *)segs[k].start.buf)[i] : i * segs[k].row_stride;
      memcpy(dst, src, (size_t)n);
      dst += n;
    }
  }
  Py_END_ALLOW_THREADS;
done:
  release(segs, opened);
  PyMem_Free(segs);
  Py_DECREF(seq);
  return out;
}

/* step_span_ids(prefixes, start, length, seq, row) -> bytes: the span id of each of a batch's token
 * steps (llmobs.otlp.encoder.SpanIds.step_ids), 8 bytes a row back to back: BLAKE2b-64 of row i's
 * prefix (prefixes[start[i] : start[i] + length[i]], "step\x1f<pid>\x1f<trace hex>\x1f") followed by
 * "<seq[i]>\x1f<row[i]>" in decimal, an all-zero id made 01 00.. as OTLP requires. `prefixes` is a
 * bytes-like buffer, the other four int64 buffers of one length; every prefix is bounds-checked first.
 * Python's hashlib was ~0.9 us a span here, a twentieth of the exporter's CPU. */
static PyObject *py_step_span_ids(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "step_span_ids(prefixes, start, length, seq, row)");
    return NULL;
  }
  Py_buffer text, start, length, seq, row;
  PyObject *out = NULL;
  uint8_t *buffer = NULL;
  if (PyObject_GetBuffer(args[0], &text, PyBUF_C_CONTIGUOUS) < 0) return NULL;
  Py_ssize_t rows = PyObject_Length(args[1]);
  if (rows < 0 || int64_vector(args[1], &start, rows, "start") < 0) goto release_text;
  if (int64_vector(args[2], &length, rows, "length") < 0) goto release_start;
  if (int64_vector(args[3], &seq, rows, "seq") < 0) goto release_length;
  if (int64_vector(args[4], &row, rows, "row") < 0) goto release_seq;
  const int64_t *s = start.buf, *n = length.buf;
  Py_ssize_t longest = 0;
  for (Py_ssize_t i = 0; i < rows; i++) {
    if (s[i] < 0 || n[i] < 0 || s[i] > text.len || n[i] > text.len - s[i]) {
      PyErr_SetString(PyExc_ValueError, "a prefix is out of the prefixes buffer");
      goto release_row;
    }
    if (n[i] > longest) longest = n[i];
  }
  /* the prefix, two decimals of at most 20 characters and their separator */
  buffer = PyMem_Malloc((size_t)longest + 41);
  if (!buffer) {
    PyErr_NoMemory();
    goto release_row;
  }
  out = PyBytes_FromStringAndSize(NULL, rows * 8);
  if (out) {
    uint8_t *ids = (uint8_t *)PyBytes_AsString(out);
    const uint8_t *prefixes = text.buf;
    const int64_t *q = seq.buf, *r = row.buf;
    static const uint8_t zero[8];
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < rows; i++) {
      uint32_t len = (uint32_t)n[i];
      memcpy(buffer, prefixes + s[i], len);
      len += llmobs_decimal(q[i], buffer + len);
      buffer[len++] = 0x1f;
      len += llmobs_decimal(r[i], buffer + len);
      blake2b_64(buffer, len, ids + 8 * i);
      if (!memcmp(ids + 8 * i, zero, 8)) ids[8 * i] = 1;
    }
    Py_END_ALLOW_THREADS;
  }
  PyMem_Free(buffer);
release_row:
  PyBuffer_Release(&row);
release_seq:
  PyBuffer_Release(&seq);
release_length:
  PyBuffer_Release(&length);
release_start:
  PyBuffer_Release(&start);
release_text:
  PyBuffer_Release(&text);
  return out;
}

static PyMethodDef methods[] = {
    {"gather", (PyCFunction)(void (*)(void))py_gather, METH_FASTCALL,
     "gather(rows, total, segments) -> bytes: each row's segments back to back"},
    {"step_span_ids", (PyCFunction)(void (*)(void))py_step_span_ids, METH_FASTCALL,
     "step_span_ids(prefixes, start, length, seq, row) -> bytes: each token step's 8-byte span id"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire_gather", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__wire_gather(void) { return PyModule_Create(&module); }
