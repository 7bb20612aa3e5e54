/* What every op does around its kernel: one device for all tensors, the device made current,
 * the caller's stream chosen, and the output allocated (by the caller's framework when it
 * publishes a DLPack exchange API, so torch outputs come from torch's caching allocator). */
#include "qk.h"

#include <string.h>

int qk_same_device(const char *op, const qk_view *views, const char *const *names, int n) {
    for (int i = 1; i < n; i++) {
        if (views[i].device_type != views[0].device_type || views[i].device_id != views[0].device_id) {
            char a[64], b[64];
            qk_device_str(a, sizeof a, views[0].device_type, views[0].device_id);
            qk_device_str(b, sizeof b, views[i].device_type, views[i].device_id);
            PyErr_Format(PyExc_ValueError, "%s: all tensors must be on one device; %s is on %s but %s is on %s", op,
                         names[0], a, names[i], b);
            return -1;
        }
    }
    return 0;
}

int qk_plan_arg(qk_state *st, PyObject *obj, const char *op, void *stream, int64_t len, const char *layout,
                const qk_view *like, qk_view *v) {
    if (obj == NULL || obj == Py_None) return 0;
    if (qk_import(st, obj, op, "plan", stream, v) < 0) return -1;
    if (v->dtype != QK_I32)
        PyErr_Format(PyExc_TypeError, "%s: plan must be int32 (the output of the op's plan function), got %s", op,
                     qk_dtype_name(v->dtype));
    else if (v->ndim != 1 || v->shape[0] != len)
        PyErr_Format(PyExc_ValueError, "%s: plan must have shape [%s] = [%lld] for these inputs", op, layout,
                     (long long)len);
    else if (len > 1 && v->strides[0] != 1)
        PyErr_Format(PyExc_ValueError, "%s: plan must be contiguous (stride 1), got stride %lld", op,
                     (long long)v->strides[0]);
    else if (v->device_type != like->device_type || v->device_id != like->device_id)
        PyErr_Format(PyExc_ValueError, "%s: plan must be on the device of the other inputs", op);
    else
        return 1;
    qk_views_release(v, 1);
    return -1;
}

int qk_import_all(qk_state *st, const char *op, PyObject *const *objs, const char *const *names, int n, void *stream,
                  qk_view *in, int *n_in) {
    for (; *n_in < n; (*n_in)++)
        if (qk_import(st, objs[*n_in], op, names[*n_in], stream, &in[*n_in]) < 0) return -1;
    return qk_same_device(op, in, names, n);
}

int qk_launch_begin(qk_state *st, const char *op, const qk_view *first, void *stream, int stream_given,
                    qk_launch *l) {
    memset(l, 0, sizeof *l);
    l->device_type = first->device_type;
    l->device_id = first->device_id;
    l->prev_device = -1;
    if (first->device_type != kDLCUDA) return 0;
    l->cuda = qk_cuda(st, op);
    if (l->cuda == NULL) return -1;
    int status = l->cuda->get_device(&l->prev_device);
    if (!status && l->prev_device != first->device_id) {
        status = l->cuda->set_device(first->device_id);
        l->switched = !status;
    }
    if (status) return qk_raise_status(op, status);
    if (stream_given) {
        l->stream = stream;
    } else if (first->api) {
        if (first->api->current_work_stream(kDLCUDA, first->device_id, &l->stream) != 0) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "%s: could not query the current stream", op);
            qk_launch_end(l);
            return -1;
        }
    }
    return 0;
}

void qk_launch_end(qk_launch *l) {
    if (l->switched) l->cuda->set_device(l->prev_device);
    l->switched = 0;
}

int qk_index_check(const qk_state *st, const qk_launch *l, const void *idx, int dtype, int64_t n, int64_t stride,
                   int64_t hi, int64_t *bad_pos, int64_t *bad_value) {
    if (l->device_type != kDLCUDA || !st->check_indices) return QK_OK;
    return l->cuda->index_check(idx, dtype, n, stride, 0, hi, bad_pos, bad_value, l->stream);
}

int qk_graph_status(const char *op, int status, const char *arg, int64_t bad_pos, int64_t bad_value,
                    int64_t num_graphs) {
    if (status != QK_E_INDEX || arg == NULL) return qk_raise_status(op, status);
    PyErr_Format(PyExc_ValueError, "%s: %s[%lld] = %lld is out of range for num_graphs = %lld", op, arg,
                 (long long)bad_pos, (long long)bad_value, (long long)num_graphs);
    return -1;
}

static void qk_set_error(void *ctx, const char *kind, const char *message) {
    (void)ctx;
    PyObject *exc = PyExc_RuntimeError;
    if (kind && strcmp(kind, "MemoryError") == 0) exc = PyExc_MemoryError;
    else if (kind && strcmp(kind, "ValueError") == 0) exc = PyExc_ValueError;
    else if (kind && strcmp(kind, "TypeError") == 0) exc = PyExc_TypeError;
    else if (kind && strcmp(kind, "BufferError") == 0) exc = PyExc_BufferError;
    PyErr_SetString(exc, message ? message : "allocation failed");
}

/* A fresh C-contiguous tensor from the framework's allocator (its exchange API) on the call's device;
 * NULL with an exception. */
static DLManagedTensorVersioned *qk_exchange_alloc(const char *op, const DLPackExchangeAPI *api, const qk_launch *l,
                                                   int dtype, int ndim, const int64_t *shape) {
    DLTensor proto = {0};
    proto.device.device_type = l->device_type;
    proto.device.device_id = l->device_type == kDLCUDA ? l->device_id : 0;
    proto.ndim = ndim;
    proto.dtype = qk_dtype_to_dl(dtype);
    proto.shape = (int64_t *)shape;
    DLManagedTensorVersioned *mt = NULL;
    if (api->managed_tensor_allocator(&proto, &mt, NULL, qk_set_error) != 0 || mt == NULL) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_MemoryError, "%s: the framework could not allocate out", op);
        return NULL;
    }
    return mt;
}

int qk_output_prepare(qk_state *st, const char *op, PyObject *out_obj, const qk_view *like, int dtype, int ndim,
                      const int64_t *shape, const qk_launch *l, qk_view *ov, qk_output *o) {
    memset(o, 0, sizeof *o);
    memset(ov, 0, sizeof *ov);
    int64_t numel, bytes;
    if (qk_nbytes(ndim, shape, qk_dtype_size(dtype), &numel, &bytes) < 0) {
        char want[160];
        qk_shape_str(want, sizeof want, shape, ndim);
        PyErr_Format(PyExc_MemoryError, "%s: out of shape %s and dtype %s would need more than 2^63 bytes", op, want,
                     qk_dtype_name(dtype));
        return -1;
    }
    if (out_obj && out_obj != Py_None) {
        if (qk_import(st, out_obj, op, "out", l->stream, ov) < 0) return -1;
        char want[160], got[160];
        int bad_shape = ov->ndim != ndim;
        for (int i = 0; !bad_shape && i < ndim; i++) bad_shape = ov->shape[i] != shape[i];
        if (ov->readonly) {
            PyErr_Format(PyExc_BufferError, "%s: out is read-only", op);
        } else if (ov->dtype != dtype) {
            PyErr_Format(PyExc_TypeError, "%s: out must be %s, got %s", op, qk_dtype_name(dtype),
                         qk_dtype_name(ov->dtype));
        } else if (bad_shape) {
            qk_shape_str(want, sizeof want, shape, ndim);
            qk_shape_str(got, sizeof got, ov->shape, ov->ndim);
            PyErr_Format(PyExc_ValueError, "%s: out must have shape %s, got %s", op, want, got);
        } else if (ov->device_type != l->device_type || ov->device_id != l->device_id) {
            qk_device_str(want, sizeof want, l->device_type, l->device_id);
            qk_device_str(got, sizeof got, ov->device_type, ov->device_id);
            PyErr_Format(PyExc_ValueError, "%s: out must be on %s like the inputs, got %s", op, want, got);
        } else {
            int empty = 0; /* an empty tensor's strides are arbitrary (NumPy exports 0s): nothing overlaps */
            for (int i = 0; i < ndim; i++) empty |= ov->shape[i] == 0;
            for (int i = 0; i < ndim && !empty; i++) {
                if (ov->strides[i] == 0 && ov->shape[i] > 1) {
                    PyErr_Format(PyExc_ValueError,
                                 "%s: out has stride 0 in dimension %d, so its elements overlap; pass a writable "
                                 "tensor with distinct elements",
                                 op, i);
                    break;
                }
            }
        }
        if (PyErr_Occurred()) {
            qk_views_release(ov, 1);
            return -1;
        }
        o->result = Py_NewRef(out_obj);
        o->bump_version = qk_version_bumper(st, out_obj);
        return 0;
    }
    if (like->api) {
        DLManagedTensorVersioned *mt = qk_exchange_alloc(op, like->api, l, dtype, ndim, shape);
        if (mt == NULL) return -1;
        o->mt = mt;
        o->api = like->api;
        ov->data = (char *)mt->dl_tensor.data + mt->dl_tensor.byte_offset;
        ov->device_type = l->device_type;
        ov->device_id = l->device_id;
        ov->dtype = dtype;
        ov->ndim = ndim;
        int64_t c = 1;
        for (int i = ndim - 1; i >= 0; i--) {
            ov->shape[i] = shape[i];
            ov->strides[i] = mt->dl_tensor.strides ? mt->dl_tensor.strides[i] : c;
            c *= shape[i];
        }
        return 0;
    }
    o->result = qk_tensor_empty(st, op, dtype, ndim, shape, l->device_type, l->device_id, l->stream);
    if (o->result == NULL) return -1;
    qk_tensor_fill_view(o->result, ov);
    return 0;
}

int qk_output_block(const char *op, const qk_view *like, const qk_launch *l, int dtype, size_t bytes, qk_view *ov,
                    qk_output *o) {
    memset(o, 0, sizeof *o);
    memset(ov, 0, sizeof *ov);
    const size_t size = qk_dtype_size(dtype);
    if (like->api == NULL || bytes > (size_t)INT64_MAX - size) {
        PyErr_Format(PyExc_MemoryError, "%s: could not allocate %zu bytes for out", op, bytes);
        return -1;
    }
    const int64_t n = (int64_t)((bytes + size - 1) / size);
    DLManagedTensorVersioned *mt = qk_exchange_alloc(op, like->api, l, dtype, 1, &n);
    if (mt == NULL) return -1;
    /* Described as its first element only: the consumer's tensor views that, and the deleter, which
     * stays the producer's, frees the whole block. */
    mt->dl_tensor.ndim = 0;
    mt->dl_tensor.strides = NULL;
    o->mt = mt;
    o->api = like->api;
    ov->data = (char *)mt->dl_tensor.data + mt->dl_tensor.byte_offset;
    ov->device_type = l->device_type;
    ov->device_id = l->device_id;
    ov->dtype = dtype;
    ov->ndim = 0;
    return 0;
}

/* The element offsets (from its data pointer) of the first and last elements a view reaches along
 * dimensions from..ndim-1; 0 when one of those dimensions is empty. */
static int qk_view_span(const qk_view *v, int from, int64_t *first, int64_t *last) {
    *first = *last = 0;
    for (int i = from; i < v->ndim; i++) {
        if (v->shape[i] == 0) return 0;
        const int64_t step = (v->shape[i] - 1) * v->strides[i]; /* bounded by qk_view_extent at import */
        if (step < 0) *first += step;
        else *last += step;
    }
    return 1;
}

/* [lo, hi): the bytes a view can touch; empty when it has no elements. */
static void qk_view_bytes(const qk_view *v, uintptr_t *lo, uintptr_t *hi) {
    int64_t first, last;
    if (!qk_view_span(v, 0, &first, &last)) {
        *lo = *hi = 0;
        return;
    }
    const int64_t size = (int64_t)qk_dtype_size(v->dtype);
    *lo = (uintptr_t)v->data + (uintptr_t)(first * size);
    *hi = (uintptr_t)v->data + (uintptr_t)((last + 1) * size);
}

/* Whether two views whose byte ranges meet are still disjoint as rows of one period: dimension 0
 * steps both by the same S bytes, and each row's block of the other dimensions lies in its own part
 * of every S bytes (q, k and v split out of one fused qkv projection). A sufficient test only. */
static int qk_rows_disjoint(const qk_view *a, const qk_view *b) {
    if (a->ndim < 1 || b->ndim < 1) return 0;
    const int64_t sa = a->strides[0] * (int64_t)qk_dtype_size(a->dtype);
    const int64_t sb = b->strides[0] * (int64_t)qk_dtype_size(b->dtype);
    int64_t period;
    if (a->shape[0] > 1 && b->shape[0] > 1) {
        if (sa != sb) return 0;
        period = sa;
    } else {
        period = a->shape[0] > 1 ? sa : sb; /* a single row's stride says nothing */
    }
    if (period <= 0) return 0;
    int64_t start[2], width[2];
    const qk_view *v[2] = {a, b};
    for (int j = 0; j < 2; j++) { /* each row's block: the span of dimensions 1.. */
        const int64_t size = (int64_t)qk_dtype_size(v[j]->dtype);
        int64_t first, last;
        if (!qk_view_span(v[j], 1, &first, &last)) return 0;
        start[j] = (int64_t)(intptr_t)v[j]->data + first * size;
        width[j] = (last - first + 1) * size;
        if (width[j] > period) return 0;
    }
    int64_t d = (start[1] - start[0]) % period;
    if (d < 0) d += period;
    return d >= width[0] && d + width[1] <= period;
}

int qk_views_overlap(const qk_view *a, const qk_view *b) {
    if (a->device_type != b->device_type || a->device_id != b->device_id) return 0;
    uintptr_t alo, ahi, blo, bhi;
    qk_view_bytes(a, &alo, &ahi);
    qk_view_bytes(b, &blo, &bhi);
    return alo < ahi && blo < bhi && alo < bhi && blo < ahi && !qk_rows_disjoint(a, b);
}

static int qk_same_view(const qk_view *a, const qk_view *b) {
    if (a->data != b->data || a->dtype != b->dtype || a->ndim != b->ndim) return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i] || (a->shape[i] > 1 && a->strides[i] != b->strides[i])) return 0;
    return 1;
}

int qk_out_overlap(const char *op, const qk_view *out, const qk_view *in, const char *const *names, int n,
                   unsigned in_place) {
    uintptr_t olo, ohi;
    qk_view_bytes(out, &olo, &ohi);
    for (int i = 0; i < n && olo < ohi; i++) {
        if (in[i].data == NULL || in[i].device_type != out->device_type || in[i].device_id != out->device_id) continue;
        uintptr_t lo, hi;
        qk_view_bytes(&in[i], &lo, &hi);
        if (lo >= hi || hi <= olo || ohi <= lo || qk_rows_disjoint(out, &in[i])) continue;
        if ((in_place >> i & 1) && qk_same_view(out, &in[i])) continue;
        PyErr_Format(PyExc_ValueError,
                     (in_place >> i & 1) ? "%s: out overlaps %s in memory; pass out=%s itself for the in-place "
                                           "form, or a separate tensor"
                                         : "%s: out overlaps %s in memory, which the op reads while writing out; pass "
                                           "a separate tensor%s",
                     op, names[i], (in_place >> i & 1) ? names[i] : "");
        return -1;
    }
    return 0;
}

PyObject *qk_op_finish(qk_launch *l, int launched, qk_output *o, qk_view *ov, int ok, qk_view *in, int n_in) {
    if (launched) qk_launch_end(l);
    PyObject *result = launched ? qk_output_finish(o, ov, ok) : NULL;
    qk_views_release(in, n_in);
    return result;
}

PyObject *qk_op_finish_many(qk_launch *l, int launched, qk_output *o, qk_view *ov, int n_out, int ok, qk_view *in,
                            int n_in) {
    if (launched) qk_launch_end(l);
    PyObject *result = NULL;
    if (launched) {
        result = ok ? PyTuple_New(n_out) : NULL;
        for (int i = 0; i < n_out; i++) {
            PyObject *r = o[i].result || o[i].mt ? qk_output_finish(&o[i], &ov[i], result != NULL) : Py_NewRef(Py_None);
            if (result && r == NULL) Py_CLEAR(result);
            if (result) PyTuple_SET_ITEM(result, i, r);
            else Py_XDECREF(r);
        }
    }
    qk_views_release(in, n_in);
    return result;
}

PyObject *qk_output_finish(qk_output *o, qk_view *ov, int ok) {
    qk_views_release(ov, 1);
    if (!ok) {
        if (o->mt) {
            qk_saved_error e = qk_error_save();
            o->mt->deleter(o->mt);
            qk_error_restore(e);
        }
        o->mt = NULL;
        Py_CLEAR(o->result);
        return NULL;
    }
    if (o->mt) {
        void *obj = NULL;
        DLManagedTensorVersioned *mt = o->mt;
        o->mt = NULL;
        if (o->api->managed_tensor_to_py_object_no_sync(mt, &obj) != 0) return NULL; /* ownership was taken */
        return (PyObject *)obj;
    }
    PyObject *r = o->result;
    o->result = NULL;
    if (o->bump_version) {
        PyObject *tensors = PyTuple_Pack(1, r);
        PyObject *moved = tensors ? PyObject_CallOneArg(o->bump_version, tensors) : NULL;
        Py_XDECREF(tensors);
        if (moved == NULL) Py_CLEAR(r);
        Py_XDECREF(moved);
    }
    return r;
}
