/* DLPack import: any __dlpack__ producer, a raw capsule, or a framework's C exchange API. */
#include "qk.h"

#include <string.h>

static const struct {
    const char *name;
    uint8_t code, bits;
    size_t size;
} qk_dtypes[] = {
    [QK_F32] = {"float32", kDLFloat, 32, 4}, [QK_F16] = {"float16", kDLFloat, 16, 2},
    [QK_BF16] = {"bfloat16", kDLBfloat, 16, 2}, [QK_F64] = {"float64", kDLFloat, 64, 8},
    [QK_I32] = {"int32", kDLInt, 32, 4},     [QK_I64] = {"int64", kDLInt, 64, 8},
    [QK_BOOL] = {"bool", kDLBool, 8, 1},
};
#define QK_NUM_DTYPES ((int)(sizeof qk_dtypes / sizeof qk_dtypes[0]))

const char *qk_dtype_name(int dtype) { return dtype >= 0 && dtype < QK_NUM_DTYPES ? qk_dtypes[dtype].name : "?"; }
size_t qk_dtype_size(int dtype) { return dtype >= 0 && dtype < QK_NUM_DTYPES ? qk_dtypes[dtype].size : 0; }

int qk_dtype_from_name(const char *name) {
    for (int i = 0; i < QK_NUM_DTYPES; i++)
        if (strcmp(qk_dtypes[i].name, name) == 0) return i;
    return -1;
}

DLDataType qk_dtype_to_dl(int dtype) {
    DLDataType t = {qk_dtypes[dtype].code, qk_dtypes[dtype].bits, 1};
    return t;
}

int qk_dtype_from_dl(DLDataType t) {
    switch (t.code << 8 | t.bits) {
    case kDLFloat << 8 | 32: return QK_F32;
    case kDLFloat << 8 | 16: return QK_F16;
    case kDLBfloat << 8 | 16: return QK_BF16;
    case kDLFloat << 8 | 64: return QK_F64;
    case kDLInt << 8 | 32: return QK_I32;
    case kDLInt << 8 | 64: return QK_I64;
    case kDLBool << 8 | 8: return QK_BOOL;
    default: return -1;
    }
}

void qk_device_str(char *buf, size_t n, int device_type, int device_id) {
    switch (device_type) {
    case kDLCPU: snprintf(buf, n, "cpu"); break;
    case kDLCUDA: snprintf(buf, n, "cuda:%d", device_id); break;
    case kDLCUDAHost: snprintf(buf, n, "cuda_host"); break;
    case kDLCUDAManaged: snprintf(buf, n, "cuda_managed:%d", device_id); break;
    default: snprintf(buf, n, "dlpack device type %d:%d", device_type, device_id);
    }
}

/* With the GIL held: producers' deleters may run Python code (NumPy's drops an array reference),
 * which must not see the exception an op is about to raise. */
void qk_views_release(qk_view *v, int n) {
    int owned = 0; /* views through an exchange API own nothing: no deleter, nothing to keep */
    for (int i = 0; i < n; i++) owned |= v[i].owner != NULL;
    if (!owned) return;
    qk_saved_error e = qk_error_save();
    for (int i = 0; i < n; i++) qk_view_release(&v[i]);
    qk_error_restore(e);
}

void qk_view_release(qk_view *v) {
    if (v->owner) {
        if (v->owner_versioned) {
            DLManagedTensorVersioned *m = v->owner;
            if (m->deleter) m->deleter(m);
        } else {
            DLManagedTensor *m = v->owner;
            if (m->deleter) m->deleter(m);
        }
        v->owner = NULL;
    }
}

/* Inlined into every import (qk_view_from_dl); the extern forms below serve the other callers. */
static inline __attribute__((always_inline)) int qk_nbytes_inline(int ndim, const int64_t *shape, size_t itemsize,
                                                                   int64_t *numel, int64_t *bytes) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0 || __builtin_mul_overflow(n, shape[i], &n)) return -1;
    *numel = n;
    return __builtin_mul_overflow(n, (int64_t)itemsize, bytes) ? -1 : 0;
}

int qk_nbytes(int ndim, const int64_t *shape, size_t itemsize, int64_t *numel, int64_t *bytes) {
    return qk_nbytes_inline(ndim, shape, itemsize, numel, bytes);
}

static inline __attribute__((always_inline)) int qk_view_extent_inline(const qk_view *v, size_t itemsize,
                                                                        int64_t *numel, int64_t *span) {
    int64_t bytes;
    if (qk_nbytes_inline(v->ndim, v->shape, itemsize, numel, &bytes) < 0) return -1;
    /* The bytes between the lowest and the highest element, plus one element: what a kernel can touch. */
    int64_t reach = 0;
    for (int i = 0; i < v->ndim && *numel > 0; i++) {
        uint64_t stride = v->strides[i] < 0 ? 0 - (uint64_t)v->strides[i] : (uint64_t)v->strides[i];
        int64_t step;
        if (stride > INT64_MAX || __builtin_mul_overflow(v->shape[i] - 1, (int64_t)stride, &step) ||
            __builtin_add_overflow(reach, step, &reach))
            return -1;
    }
    if (__builtin_add_overflow(reach, 1, &reach) || __builtin_mul_overflow(reach, (int64_t)itemsize, span)) return -1;
    return 0;
}

int qk_view_extent(const qk_view *v, size_t itemsize, int64_t *numel, int64_t *span) {
    return qk_view_extent_inline(v, itemsize, numel, span);
}

/* Fill v from a DLTensor (borrowed pointers are copied out, so the DLTensor may go away). */
static int qk_view_from_dl(const DLTensor *t, int readonly, const char *op, const char *arg, qk_view *v) {
    if (t->dtype.lanes != 1) {
        PyErr_Format(PyExc_BufferError, "%s: %s has %d vector lanes; only lanes == 1 is supported", op, arg,
                     (int)t->dtype.lanes);
        return -1;
    }
    int dtype = qk_dtype_from_dl(t->dtype);
    if (dtype < 0) {
        PyErr_Format(PyExc_TypeError,
                     "%s: %s has an unsupported dtype (DLPack code %d, %d bits); expected float32, float16, "
                     "bfloat16, float64, int32, int64 or bool",
                     op, arg, (int)t->dtype.code, (int)t->dtype.bits);
        return -1;
    }
    switch (t->device.device_type) {
    case kDLCPU:
    case kDLCUDAHost: /* pinned host memory: the CPU kernels read it directly */
        v->device_type = kDLCPU;
        v->device_id = 0;
        break;
    case kDLCUDA:
    case kDLCUDAManaged:
        v->device_type = kDLCUDA;
        v->device_id = t->device.device_id;
        break;
    default: {
        char dev[64];
        qk_device_str(dev, sizeof dev, t->device.device_type, t->device.device_id);
        PyErr_Format(PyExc_BufferError, "%s: %s lives on %s; qkernels reads cpu and cuda memory only", op, arg,
                     dev);
        return -1;
    }
    }
    if (t->ndim < 0 || t->ndim > QK_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "%s: %s has %d dimensions; at most %d are supported", op, arg, (int)t->ndim,
                     QK_MAX_DIMS);
        return -1;
    }
    if (t->ndim > 0 && t->shape == NULL) {
        PyErr_Format(PyExc_BufferError, "%s: %s is a malformed DLPack tensor: %d dimensions but no shape", op, arg,
                     (int)t->ndim);
        return -1;
    }
    int64_t contiguous = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] < 0) {
            PyErr_Format(PyExc_BufferError, "%s: %s is a malformed DLPack tensor: size %lld in dimension %d", op, arg,
                         (long long)t->shape[i], i);
            return -1;
        }
        v->shape[i] = t->shape[i];
        v->strides[i] = t->strides ? t->strides[i] : contiguous;
        if (__builtin_mul_overflow(contiguous, t->shape[i], &contiguous)) contiguous = INT64_MAX;
    }
    v->ndim = t->ndim;
    int64_t numel, span;
    if (qk_view_extent_inline(v, qk_dtypes[dtype].size, &numel, &span) < 0) {
        char shape[160];
        qk_shape_str(shape, sizeof shape, v->shape, v->ndim);
        PyErr_Format(PyExc_ValueError, "%s: %s of shape %s and %s is too large: its size in bytes overflows 64 bits",
                     op, arg, shape, qk_dtype_name(dtype));
        return -1;
    }
    if (numel > 0 && t->data == NULL) {
        PyErr_Format(PyExc_BufferError, "%s: %s is a malformed DLPack tensor: %lld elements at a NULL data pointer",
                     op, arg, (long long)numel);
        return -1;
    }
    v->raw_device_type = t->device.device_type;
    v->dtype = dtype;
    v->readonly = readonly;
    v->data = (char *)t->data + t->byte_offset;
    return 0;
}

const DLTensor *qk_capsule_peek(PyObject *obj) {
    if (!PyCapsule_CheckExact(obj)) return NULL;
    const char *name = PyCapsule_GetName(obj);
    if (name == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (strcmp(name, QK_CAPSULE_VERSIONED) == 0) {
        const DLManagedTensorVersioned *m = PyCapsule_GetPointer(obj, QK_CAPSULE_VERSIONED);
        return m && m->version.major <= QK_DLPACK_MAJOR ? &m->dl_tensor : NULL;
    }
    if (strcmp(name, QK_CAPSULE_LEGACY) == 0) {
        const DLManagedTensor *m = PyCapsule_GetPointer(obj, QK_CAPSULE_LEGACY);
        return m ? &m->dl_tensor : NULL;
    }
    return NULL;
}

/* Take ownership of the managed tensor in a capsule and rename it so nobody uses it twice. */
int qk_import_capsule(PyObject *capsule, const char *op, const char *arg, qk_view *v) {
    const char *name = PyCapsule_GetName(capsule);
    if (name == NULL && PyErr_Occurred()) return -1;
    if (name && strcmp(name, QK_CAPSULE_VERSIONED) == 0) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, QK_CAPSULE_VERSIONED);
        if (m == NULL) return -1;
        if (m->version.major > QK_DLPACK_MAJOR) {
            PyErr_Format(PyExc_BufferError, "%s: %s is a DLPack %u.%u tensor; this build reads major version %d",
                         op, arg, m->version.major, m->version.minor, QK_DLPACK_MAJOR);
            return -1; /* per the standard the capsule keeps ownership: its destructor frees it */
        }
        if (qk_view_from_dl(&m->dl_tensor, (m->flags & QK_DLPACK_FLAG_READ_ONLY) != 0, op, arg, v) < 0) return -1;
        if (PyCapsule_SetName(capsule, QK_CAPSULE_VERSIONED_USED) < 0) return -1;
        v->owner = m;
        v->owner_versioned = 1;
        return 0;
    }
    if (name && strcmp(name, QK_CAPSULE_LEGACY) == 0) {
        DLManagedTensor *m = PyCapsule_GetPointer(capsule, QK_CAPSULE_LEGACY);
        if (m == NULL) return -1;
        if (qk_view_from_dl(&m->dl_tensor, 0, op, arg, v) < 0) return -1;
        if (PyCapsule_SetName(capsule, QK_CAPSULE_LEGACY_USED) < 0) return -1;
        v->owner = m;
        v->owner_versioned = 0;
        return 0;
    }
    if (name && (strcmp(name, QK_CAPSULE_LEGACY_USED) == 0 || strcmp(name, QK_CAPSULE_VERSIONED_USED) == 0)) {
        PyErr_Format(PyExc_BufferError, "%s: %s is a DLPack capsule that was already consumed", op, arg);
        return -1;
    }
    PyErr_Format(PyExc_BufferError, "%s: %s is a capsule named '%s', not a DLPack tensor", op, arg,
                 name ? name : "(null)");
    return -1;
}

/* What the importer knows about a tensor type, looked up once per type: the DLPack C exchange API
 * it publishes (NULL: none) and, where its tensors carry autograd state (torch's requires_grad and
 * lazy negation bit, which DLPack cannot express), the type's descriptors of the two (borrowed from
 * the state, which owns them). */
typedef struct {
    const DLPackExchangeAPI *api;
    PyObject *requires_grad, *is_neg;
} qk_type_info;

static qk_type_info qk_type_lookup(qk_state *st, PyTypeObject *type) {
    for (int i = 0; i < st->num_api_types; i++)
        if (st->api_types[i] == type) return (qk_type_info){st->apis[i], st->requires_grad_desc[i], st->is_neg_desc[i]};
    qk_type_info info = {NULL, NULL, NULL};
    PyObject *cap = PyObject_GetAttr((PyObject *)type, st->str_exchange_api);
    if (cap == NULL) {
        PyErr_Clear();
    } else {
        if (PyCapsule_CheckExact(cap) && PyCapsule_IsValid(cap, QK_CAPSULE_EXCHANGE_API)) {
            const DLPackExchangeAPI *api = PyCapsule_GetPointer(cap, QK_CAPSULE_EXCHANGE_API);
            /* Only tables whose major version we know, with the entries we call. */
            if (api && api->header.version.major == 1 && api->dltensor_from_py_object_no_sync &&
                api->current_work_stream && api->managed_tensor_allocator && api->managed_tensor_to_py_object_no_sync)
                info.api = api;
        }
        /* The table must stay alive for the process (DLPack's rule); the capsule is held by the type. */
        Py_DECREF(cap);
    }
    /* Both attributes or neither: a type's requires_grad is a data descriptor read with its __get__,
     * is_neg a method called with the tensor as self. */
    PyObject *rg = PyObject_GetAttr((PyObject *)type, st->str_requires_grad);
    PyObject *neg = rg ? PyObject_GetAttr((PyObject *)type, st->str_is_neg) : NULL;
    if (rg == NULL || neg == NULL || Py_TYPE(rg)->tp_descr_get == NULL) {
        PyErr_Clear();
        Py_CLEAR(rg);
        Py_CLEAR(neg);
    }
    info.requires_grad = rg, info.is_neg = neg;
    if (st->num_api_types < QK_MAX_API_TYPES) {
        Py_INCREF(type);
        st->api_types[st->num_api_types] = type;
        st->apis[st->num_api_types] = info.api;
        st->requires_grad_desc[st->num_api_types] = rg; /* the state owns the references from here */
        st->is_neg_desc[st->num_api_types] = neg;
        st->num_api_types++;
    } else {
        /* a full table: this call's info keeps working until the types leave (module lifetime) */
        Py_XDECREF(rg);
        Py_XDECREF(neg);
    }
    return info;
}

const DLPackExchangeAPI *qk_exchange_api(qk_state *st, PyTypeObject *type) { return qk_type_lookup(st, type).api; }

PyObject *qk_version_bumper(qk_state *st, PyObject *obj) {
    if (!qk_type_lookup(st, Py_TYPE(obj)).requires_grad) return NULL;
    if (st->bump_version == NULL) {
        PyObject *torch_c = PyImport_ImportModule("torch._C"); /* already imported: the caller holds a tensor */
        st->bump_version = torch_c ? PyObject_GetAttrString(torch_c, "_increment_version") : NULL;
        Py_XDECREF(torch_c);
        if (st->bump_version == NULL) PyErr_Clear(); /* a torch without it has no version counters to keep */
    }
    return st->bump_version;
}

/* torch.is_grad_enabled(), found once; 1, 0 or -1 with an exception set. */
static int qk_grad_enabled(qk_state *st) {
    if (st->grad_enabled == NULL) {
        PyObject *torch = PyImport_ImportModule("torch"); /* already imported: the caller holds a tensor */
        if (torch == NULL) return -1;
        st->grad_enabled = PyObject_GetAttrString(torch, "is_grad_enabled");
        Py_DECREF(torch);
        if (st->grad_enabled == NULL) return -1;
    }
    PyObject *on = PyObject_CallNoArgs(st->grad_enabled);
    if (on == NULL) return -1;
    int r = PyObject_IsTrue(on);
    Py_DECREF(on);
    return r;
}

/* descr.__get__(obj) for a descriptor found on obj's type: a getset descriptor's getter called
 * directly (obj's type is the type it was found on, so the subtype check of the generic path holds). */
static PyObject *qk_descr_read(PyObject *descr, PyObject *obj) {
    if (Py_IS_TYPE(descr, &PyGetSetDescr_Type)) {
        PyGetSetDef *gs = ((PyGetSetDescrObject *)descr)->d_getset;
        if (gs->get) return gs->get(obj, gs->closure);
    }
    return Py_TYPE(descr)->tp_descr_get(descr, obj, (PyObject *)Py_TYPE(obj));
}

/* meth(obj) for a method found on obj's type: a METH_NOARGS C method called directly, as its
 * descriptor's call would after the same subtype check. */
static PyObject *qk_method_call0(PyObject *meth, PyObject *obj) {
    if (Py_IS_TYPE(meth, &PyMethodDescr_Type)) {
        PyMethodDef *def = ((PyMethodDescrObject *)meth)->d_method;
        if ((def->ml_flags & ~METH_COEXIST) == METH_NOARGS) return def->ml_meth(obj, NULL);
    }
    return PyObject_Vectorcall(meth, &obj, 1, NULL);
}

/* The truth of a flag torch returns (a bool); -1 with an exception. */
static int qk_flag_take(PyObject *flag) {
    if (flag == NULL) return -1;
    const int r = flag == Py_True ? 1 : flag == Py_False ? 0 : PyObject_IsTrue(flag);
    Py_DECREF(flag);
    return r;
}

/* A tensor whose autograd state DLPack would drop: refuse it rather than compute without it.
 * 1: it requires grad but grad mode is off (export a detached view); 0: nothing to drop; -1: error. */
static int qk_autograd_check(qk_state *st, const qk_type_info *info, PyObject *obj, const char *op, const char *arg) {
    const int requires = qk_flag_take(qk_descr_read(info->requires_grad, obj));
    if (requires < 0) return -1;
    if (requires) {
        int on = qk_grad_enabled(st);
        if (on < 0) return -1;
        if (on) {
            PyErr_Format(st->grad_required,
                         "%s: %s requires grad, but the raw op does not record gradients; call qkernels.%s (which "
                         "does), or call this under torch.no_grad(), or pass %s.detach()",
                         op, arg, op, arg);
            return -1;
        }
    }
    const int neg = qk_flag_take(qk_method_call0(info->is_neg, obj));
    if (neg < 0) return -1;
    if (neg) {
        PyErr_Format(PyExc_BufferError,
                     "%s: %s is a view with torch's lazy negation bit set (such as z.conj().imag), which DLPack "
                     "cannot express; pass %s.resolve_neg()",
                     op, arg, arg);
        return -1;
    }
    return requires;
}

/* obj.__dlpack__(stream=..., max_version=(1, 1)), falling back to the legacy signature for
 * producers that reject max_version (older JAX, NumPy < 2). */
static PyObject *qk_call_dlpack(qk_state *st, PyObject *obj, PyObject *stream) {
    PyObject *meth = PyObject_GetAttr(obj, st->str_dlpack);
    if (meth == NULL) return NULL;
    PyObject *argv[2] = {stream, st->max_version};
    PyObject *cap = PyObject_Vectorcall(meth, argv, 0, st->kw_versioned);
    if (cap == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        cap = PyObject_Vectorcall(meth, argv, 0, st->kw_legacy);
    }
    Py_DECREF(meth);
    return cap;
}

/* A producer's own __dlpack__ error, re-raised as a BufferError (a MemoryError stays one) naming
 * the op and argument (NumPy's "DLPack only supports native byte order" says neither). */
static void qk_name_producer_error(const char *op, const char *arg) {
    PyObject *cause = qk_exception_take();
    if (cause == NULL) return;
    /* whatever the producer raised (torch: RuntimeError, ValueError), the tensor cannot cross DLPack */
    PyObject *exc = PyErr_GivenExceptionMatches(cause, PyExc_MemoryError) ? PyExc_MemoryError : PyExc_BufferError;
    /* the producer's first line: torch appends its C++ stack after it */
    PyObject *text = PyObject_Str(cause), *line = NULL;
    if (text) {
        Py_ssize_t end = PyUnicode_FindChar(text, '\n', 0, PyUnicode_GET_LENGTH(text), 1);
        line = end >= 0 ? PyUnicode_Substring(text, 0, end) : Py_NewRef(text);
        Py_DECREF(text);
    }
    if (line == NULL) PyErr_Clear();
    PyErr_Format(exc, "%s: %s could not be exported through DLPack: %S", op, arg, line ? line : Py_None);
    Py_XDECREF(line);
    PyObject *named = qk_exception_take();
    if (named) {
        PyException_SetCause(named, Py_NewRef(cause)); /* as `raise ... from cause` */
        PyException_SetContext(named, Py_NewRef(cause));
        qk_exception_raise(named);
    }
    Py_DECREF(cause);
}

/* Device of a __dlpack__ producer, so CPU producers get stream=None and CUDA ones a stream. */
static int qk_producer_device(qk_state *st, PyObject *obj, const char *op, const char *arg, int *device_type) {
    PyObject *dev = PyObject_CallMethodNoArgs(obj, st->str_dlpack_device);
    if (dev == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            *device_type = kDLCPU;
            return 0;
        }
        qk_name_producer_error(op, arg);
        return -1;
    }
    long t = -1;
    if (PyTuple_Check(dev) && PyTuple_GET_SIZE(dev) == 2) t = PyLong_AsLong(PyTuple_GET_ITEM(dev, 0));
    Py_DECREF(dev);
    if (t == -1) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_BufferError, "%s: %s.__dlpack_device__() did not return (device_type, device_id)",
                         op, arg);
        return -1;
    }
    *device_type = (int)t;
    return 0;
}

int qk_import(qk_state *st, PyObject *obj, const char *op, const char *arg, void *stream, qk_view *v) {
    return qk_import_ex(st, obj, op, arg, stream, 0, v);
}

/* The direct path's import of its deciding tensor, waiting for the op's first import: per thread,
 * as a call runs on one thread from its read to its imports (obj NULL: none waiting). */
static _Thread_local struct {
    PyObject *obj; /* borrowed: the caller's argument, alive for the call */
    qk_view view;
} qk_handoff;

void qk_handoff_clear(void) { qk_handoff.obj = NULL; }

int qk_direct_read(qk_state *st, PyObject *obj, int keep, DLTensor *t) {
    qk_handoff.obj = NULL;
    const qk_type_info info = qk_type_lookup(st, Py_TYPE(obj));
    if (info.api == NULL || !st->use_exchange_api) return -1;
    if (!keep) {
        if (info.api->dltensor_from_py_object_no_sync(obj, t) == 0) return 0;
        PyErr_Clear();
        return -1;
    }
    /* the op's import in its order: the autograd check, then the exchange API's read */
    int checked = 1;
    if (info.requires_grad && qk_autograd_check(st, &info, obj, "", "") < 0) {
        const int grad = PyErr_ExceptionMatches(st->grad_required);
        PyErr_Clear();
        if (grad) return -1; /* the Python path records the op for autograd */
        checked = 0;         /* the op's own import raises it, naming the op and the argument */
    }
    if (info.api->dltensor_from_py_object_no_sync(obj, t) != 0) {
        PyErr_Clear();
        return -1;
    }
    if (!checked) return 0;
    memset(&qk_handoff.view, 0, sizeof qk_handoff.view);
    if (qk_view_from_dl(t, 0, "", "", &qk_handoff.view) < 0) {
        PyErr_Clear();
        return 0;
    }
    qk_handoff.view.api = info.api;
    qk_handoff.obj = obj;
    return 1;
}

int qk_import_ex(qk_state *st, PyObject *obj, const char *op, const char *arg, void *stream, int via_capsule,
                 qk_view *v) {
    if (qk_handoff.obj) { /* the direct path's import of obj, if this is the call's first import */
        const int mine = qk_handoff.obj == obj && !via_capsule;
        qk_handoff.obj = NULL;
        if (mine) {
            *v = qk_handoff.view;
            return 0;
        }
    }
    memset(v, 0, sizeof *v);
    if (qk_is_tensor(st, obj)) {
        qk_tensor_fill_view(obj, v);
        return 0;
    }
    PyTypeObject *type = Py_TYPE(obj);
    if (PyCapsule_CheckExact(obj)) return qk_import_capsule(obj, op, arg, v);
    const qk_type_info info = qk_type_lookup(st, type);
    int detach = 0;
    if (info.requires_grad && (detach = qk_autograd_check(st, &info, obj, op, arg)) < 0) return -1;
    if (info.api && st->use_exchange_api && !via_capsule) {
        DLTensor t;
        if (info.api->dltensor_from_py_object_no_sync(obj, &t) != 0) {
            /* torch's meta and sparse tensors land here with a C++ stack: name the op and argument */
            if (!PyErr_Occurred()) PyErr_Format(PyExc_BufferError, "%s: %s could not be exported", op, arg);
            else qk_name_producer_error(op, arg);
            return -1;
        }
        if (qk_view_from_dl(&t, 0, op, arg, v) < 0) return -1;
        v->api = info.api;
        return 0;
    }
    if (!PyObject_HasAttr(obj, st->str_dlpack)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be a tensor supporting DLPack (__dlpack__), got %.200s", op, arg,
                     obj == Py_None ? "None" : type->tp_name);
        return -1;
    }
    int device_type;
    if (qk_producer_device(st, obj, op, arg, &device_type) < 0) return -1;
    PyObject *stream_obj;
    if (device_type == kDLCUDA || device_type == kDLCUDAManaged) {
        /* We launch on `stream`: the producer makes it wait for pending writes.  The legacy default
         * stream is handle 0 in CUDA but 1 in the DLPack protocol, where 0 is disallowed. */
        stream_obj = PyLong_FromVoidPtr(stream ? stream : (void *)1);
    } else {
        stream_obj = Py_NewRef(Py_None);
    }
    if (stream_obj == NULL) return -1;
    /* torch's __dlpack__ refuses a tensor that requires grad even with grad mode off, where the op
     * may read it: export a detached view of the same memory. */
    PyObject *producer = detach ? PyObject_CallMethodNoArgs(obj, st->str_detach) : Py_NewRef(obj);
    PyObject *cap = producer ? qk_call_dlpack(st, producer, stream_obj) : NULL;
    Py_XDECREF(producer);
    Py_DECREF(stream_obj);
    if (cap == NULL) {
        qk_name_producer_error(op, arg);
        return -1;
    }
    int r;
    if (!PyCapsule_CheckExact(cap)) {
        PyErr_Format(PyExc_BufferError, "%s: %s.__dlpack__() returned %.200s, not a capsule", op, arg,
                     Py_TYPE(cap)->tp_name);
        r = -1;
    } else {
        r = qk_import_capsule(cap, op, arg, v);
    }
    Py_DECREF(cap);
    return r;
}
