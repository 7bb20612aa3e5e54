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

static int qk_dtype_from_dl(DLDataType t) {
    for (int i = 0; i < QK_NUM_DTYPES; i++)
        if (qk_dtypes[i].code == t.code && qk_dtypes[i].bits == t.bits) return i;
    return -1;
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
    v->raw_device_type = t->device.device_type;
    v->dtype = dtype;
    v->ndim = t->ndim;
    v->readonly = readonly;
    v->data = (char *)t->data + t->byte_offset;
    int64_t contiguous = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        v->shape[i] = t->shape[i];
        v->strides[i] = t->strides ? t->strides[i] : contiguous;
        contiguous *= t->shape[i];
    }
    return 0;
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

/* Look up (once per type) the DLPack C exchange API a framework publishes on its tensor type. */
const DLPackExchangeAPI *qk_exchange_api(qk_state *st, PyTypeObject *type) {
    for (int i = 0; i < st->num_api_types; i++)
        if (st->api_types[i] == type) return st->apis[i];
    const DLPackExchangeAPI *api = NULL;
    PyObject *cap = PyObject_GetAttr((PyObject *)type, st->str_exchange_api);
    if (cap == NULL) {
        PyErr_Clear();
    } else {
        if (PyCapsule_CheckExact(cap) && PyCapsule_IsValid(cap, QK_CAPSULE_EXCHANGE_API)) {
            api = PyCapsule_GetPointer(cap, QK_CAPSULE_EXCHANGE_API);
            /* Only tables whose major version we know, with the entries we call. */
            if (api && (api->header.version.major != 1 || api->dltensor_from_py_object_no_sync == NULL ||
                        api->current_work_stream == NULL || api->managed_tensor_allocator == NULL ||
                        api->managed_tensor_to_py_object_no_sync == NULL))
                api = NULL;
        }
        /* The table must stay alive for the process (DLPack's rule); the capsule is held by the type. */
        Py_DECREF(cap);
    }
    if (st->num_api_types < QK_MAX_API_TYPES) {
        Py_INCREF(type);
        st->api_types[st->num_api_types] = type;
        st->apis[st->num_api_types] = api;
        st->num_api_types++;
    }
    return api;
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

/* Device of a __dlpack__ producer, so CPU producers get stream=None and CUDA ones a stream. */
static int qk_producer_device(qk_state *st, PyObject *obj, const char *op, const char *arg, int *device_type) {
    PyObject *dev = PyObject_CallMethodNoArgs(obj, st->str_dlpack_device);
    if (dev == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            *device_type = kDLCPU;
            return 0;
        }
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
    memset(v, 0, sizeof *v);
    if (qk_is_tensor(st, obj)) {
        qk_tensor_fill_view(obj, v);
        return 0;
    }
    PyTypeObject *type = Py_TYPE(obj);
    if (st->use_exchange_api) {
        const DLPackExchangeAPI *api = qk_exchange_api(st, type);
        if (api) {
            DLTensor t;
            if (api->dltensor_from_py_object_no_sync(obj, &t) != 0) {
                if (!PyErr_Occurred()) PyErr_Format(PyExc_BufferError, "%s: %s could not be exported", op, arg);
                return -1;
            }
            if (qk_view_from_dl(&t, 0, op, arg, v) < 0) return -1;
            v->api = api;
            return 0;
        }
    }
    if (PyCapsule_CheckExact(obj)) return qk_import_capsule(obj, op, arg, v);
    if (!PyObject_HasAttr(obj, st->str_dlpack)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be a tensor supporting DLPack (__dlpack__), got %.200s", op, arg,
                     type->tp_name);
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
    PyObject *cap = qk_call_dlpack(st, obj, stream_obj);
    Py_DECREF(stream_obj);
    if (cap == NULL) return -1;
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
