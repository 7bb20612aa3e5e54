/* qkernels.Tensor: the framework-neutral result type, exported through DLPack.
 *
 * Memory lives in a reference-counted storage shared by the Tensor and every capsule it has
 * exported.  The last release frees it; releases may come from any thread, with or without the
 * GIL, even during interpreter shutdown, so the storage path touches no Python object. */
#include "qk.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

enum { QK_STORAGE_HOST, QK_STORAGE_CUDA, QK_STORAGE_IMPORTED };

struct qk_storage {
    atomic_long refs;
    int kind;
    void *ptr;   /* HOST / CUDA allocation */
    void *owner; /* IMPORTED: the producer's managed tensor */
    int owner_versioned;
};

typedef struct {
    PyObject_HEAD
    qk_storage *storage;
    qk_view v;    /* data, dtype, shape, strides, device; its owner/api fields stay empty */
    void *stream; /* CUDA: the stream the producing kernel was queued on */
} qk_tensor;

/* Storages alive in this process: lets tests prove that exports free their memory. */
static atomic_long qk_live_storages;

long qk_tensor_live_storages(void) { return atomic_load(&qk_live_storages); }

static void qk_storage_release(qk_storage *s) {
    if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) != 1) return;
    atomic_fetch_sub(&qk_live_storages, 1);
    switch (s->kind) {
    case QK_STORAGE_HOST: free(s->ptr); break;
    case QK_STORAGE_CUDA: {
        const qk_cuda_api *api = qk_cuda_loaded();
        if (api) api->free(s->ptr); /* an error at process teardown (runtime unloading) is harmless */
        break;
    }
    case QK_STORAGE_IMPORTED: {
        qk_view v = {0};
        v.owner = s->owner;
        v.owner_versioned = s->owner_versioned;
        qk_view_release(&v);
        break;
    }
    }
    free(s);
}

static qk_storage *qk_storage_new(int kind, void *ptr) {
    qk_storage *s = calloc(1, sizeof *s);
    if (s == NULL) return NULL;
    atomic_init(&s->refs, 1);
    atomic_fetch_add(&qk_live_storages, 1);
    s->kind = kind;
    s->ptr = ptr;
    return s;
}

int qk_is_tensor(qk_state *st, PyObject *obj) { return Py_IS_TYPE(obj, st->tensor_type); }

void qk_tensor_fill_view(PyObject *obj, qk_view *v) { *v = ((qk_tensor *)obj)->v; }

static qk_tensor *qk_tensor_alloc(qk_state *st) {
    qk_tensor *t = PyObject_New(qk_tensor, st->tensor_type);
    if (t == NULL) return NULL;
    t->storage = NULL;
    t->stream = NULL;
    memset(&t->v, 0, sizeof t->v);
    return t;
}

PyObject *qk_tensor_empty(qk_state *st, const char *op, int dtype, int ndim, const int64_t *shape, int device_type,
                          int device_id, void *stream) {
    qk_tensor *t = qk_tensor_alloc(st);
    if (t == NULL) return NULL;
    t->v.dtype = dtype;
    t->v.ndim = ndim;
    t->v.device_type = t->v.raw_device_type = device_type;
    t->v.device_id = device_type == kDLCUDA ? device_id : 0;
    t->stream = stream;
    int64_t numel, nbytes;
    if (qk_nbytes(ndim, shape, qk_dtype_size(dtype), &numel, &nbytes) < 0) {
        PyErr_Format(PyExc_MemoryError, "%s: out would need more than 2^63 bytes", op);
        goto fail;
    }
    int64_t stride = 1; /* no overflow: the product of all sizes fits */
    for (int i = ndim - 1; i >= 0; i--) {
        t->v.shape[i] = shape[i];
        t->v.strides[i] = stride;
        stride *= shape[i];
    }
    size_t bytes = (size_t)nbytes;
    void *ptr = NULL;
    int kind;
    if (device_type == kDLCUDA) {
        const qk_cuda_api *api = qk_cuda(st, op);
        if (api == NULL) goto fail;
        int status = api->malloc(&ptr, bytes);
        if (status) {
            qk_raise_status(op, status);
            goto fail;
        }
        kind = QK_STORAGE_CUDA;
    } else {
        /* 64-byte alignment: vector loads, and consumers (JAX) that copy less aligned buffers. */
        ptr = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
        if (ptr == NULL) {
            PyErr_Format(PyExc_MemoryError, "%s: could not allocate %lld bytes for out", op, (long long)nbytes);
            goto fail;
        }
        kind = QK_STORAGE_HOST;
    }
    t->storage = qk_storage_new(kind, ptr);
    if (t->storage == NULL) {
        if (kind == QK_STORAGE_HOST) free(ptr);
        else qk_cuda_loaded()->free(ptr);
        PyErr_NoMemory();
        goto fail;
    }
    t->v.data = ptr;
    return (PyObject *)t;
fail:
    Py_DECREF(t);
    return NULL;
}

PyObject *qk_tensor_from_view(qk_state *st, qk_view *v) {
    qk_tensor *t = qk_tensor_alloc(st);
    if (t == NULL) return NULL;
    t->storage = qk_storage_new(QK_STORAGE_IMPORTED, NULL);
    if (t->storage == NULL) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    t->storage->owner = v->owner;
    t->storage->owner_versioned = v->owner_versioned;
    v->owner = NULL;
    t->v = *v;
    t->v.api = NULL;
    return (PyObject *)t;
}

static void tensor_dealloc(qk_tensor *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (self->storage) qk_storage_release(self->storage);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* ---- export ---------------------------------------------------------------------------- */

static void qk_export_deleter_versioned(DLManagedTensorVersioned *m) {
    qk_storage_release(m->manager_ctx);
    free(m);
}

static void qk_export_deleter_legacy(DLManagedTensor *m) {
    qk_storage_release(m->manager_ctx);
    free(m);
}

/* A capsule nobody consumed still owns its tensor. */
static void qk_capsule_destructor(PyObject *cap) {
    if (PyCapsule_IsValid(cap, QK_CAPSULE_VERSIONED)) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, QK_CAPSULE_VERSIONED);
        m->deleter(m);
    } else if (PyCapsule_IsValid(cap, QK_CAPSULE_LEGACY)) {
        DLManagedTensor *m = PyCapsule_GetPointer(cap, QK_CAPSULE_LEGACY);
        m->deleter(m);
    }
}

static int qk_tensor_sync_consumer(qk_tensor *self, PyObject *stream) {
    if (self->v.device_type != kDLCUDA || stream == Py_None) return 0;
    if (!PyLong_Check(stream)) {
        PyErr_SetString(PyExc_TypeError, "Tensor.__dlpack__: stream must be an int or None");
        return -1;
    }
    long long s = PyLong_AsLongLong(stream);
    if (s == -1 && PyErr_Occurred()) return -1;
    if (s == -1) return 0; /* the consumer asked for no synchronisation */
    if (s == 0) {
        PyErr_SetString(PyExc_ValueError, "Tensor.__dlpack__: stream=0 is ambiguous for CUDA; use 1 for the legacy "
                                          "default stream or 2 for the per-thread default stream");
        return -1;
    }
    void *consumer = (void *)(intptr_t)s; /* 1 and 2 are also CUDA's legacy/per-thread handles */
    if (consumer == self->stream || (self->stream == NULL && s == 1)) return 0;
    const qk_cuda_api *api = qk_cuda_loaded();
    if (api == NULL) return 0;
    int prev = -1, status = api->get_device(&prev);
    if (!status && prev != self->v.device_id) status = api->set_device(self->v.device_id);
    if (!status) status = api->stream_wait(consumer, self->stream);
    if (prev >= 0 && prev != self->v.device_id) api->set_device(prev);
    return status ? qk_raise_status("Tensor.__dlpack__", status) : 0;
}

static PyObject *tensor_dlpack(qk_tensor *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *a[4] = {NULL, NULL, NULL, NULL};
    if (qk_parse_args("Tensor.__dlpack__", args, nargs, kwnames, names, 0, 0, a) < 0) return NULL;
    PyObject *stream = a[0] ? a[0] : Py_None, *max_version = a[1] ? a[1] : Py_None;
    PyObject *dl_device = a[2] ? a[2] : Py_None, *copy = a[3] ? a[3] : Py_None;
    if (dl_device != Py_None) {
        int dt = 0, di = 0;
        if (!PyTuple_Check(dl_device) || PyTuple_GET_SIZE(dl_device) != 2 ||
            !PyArg_ParseTuple(dl_device, "ii:Tensor.__dlpack__", &dt, &di)) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "Tensor.__dlpack__: dl_device must be a (device_type, device_id) tuple "
                             "of ints, got %R", dl_device);
            }
            return NULL;
        }
        if (dt != self->v.raw_device_type || (self->v.device_type == kDLCUDA && di != self->v.device_id)) {
            PyErr_Format(PyExc_BufferError,
                         "Tensor.__dlpack__: dl_device=(%d, %d) differs from the tensor's device (%d, %d); "
                         "qkernels does not copy across devices",
                         dt, di, (int)self->v.raw_device_type, (int)self->v.device_id);
            return NULL;
        }
    }
    if (copy != Py_None) {
        int c = PyObject_IsTrue(copy);
        if (c < 0) return NULL;
        if (c) {
            PyErr_SetString(PyExc_BufferError, "Tensor.__dlpack__: copy=True is not supported; export without a "
                                               "copy and copy in the consumer");
            return NULL;
        }
    }
    int versioned = 0;
    if (max_version != Py_None) {
        if (!PyTuple_Check(max_version) || PyTuple_GET_SIZE(max_version) != 2) {
            PyErr_SetString(PyExc_TypeError, "Tensor.__dlpack__: max_version must be a (major, minor) tuple");
            return NULL;
        }
        long major = PyLong_AsLong(PyTuple_GET_ITEM(max_version, 0));
        if (major == -1 && PyErr_Occurred()) return NULL;
        versioned = major >= 1;
    }
    if (qk_tensor_sync_consumer(self, stream) < 0) return NULL;

    size_t head = versioned ? sizeof(DLManagedTensorVersioned) : sizeof(DLManagedTensor);
    head = (head + 7) / 8 * 8;
    char *block = malloc(head + 2 * (size_t)self->v.ndim * sizeof(int64_t) + 1);
    if (block == NULL) return PyErr_NoMemory();
    int64_t *shape = (int64_t *)(block + head), *strides = shape + self->v.ndim;
    memcpy(shape, self->v.shape, self->v.ndim * sizeof(int64_t));
    memcpy(strides, self->v.strides, self->v.ndim * sizeof(int64_t));
    DLTensor dl = {0};
    dl.data = self->v.data; /* byte_offset stays 0: several consumers ignore it */
    dl.device.device_type = self->v.raw_device_type;
    dl.device.device_id = self->v.device_type == kDLCUDA ? self->v.device_id : 0;
    dl.ndim = self->v.ndim;
    dl.dtype = qk_dtype_to_dl(self->v.dtype);
    dl.shape = shape;
    dl.strides = strides;
    PyObject *cap;
    atomic_fetch_add_explicit(&self->storage->refs, 1, memory_order_relaxed);
    if (versioned) {
        DLManagedTensorVersioned *m = (DLManagedTensorVersioned *)block;
        m->version.major = QK_DLPACK_MAJOR;
        m->version.minor = QK_DLPACK_MINOR;
        m->manager_ctx = self->storage;
        m->deleter = qk_export_deleter_versioned;
        m->flags = self->v.readonly ? QK_DLPACK_FLAG_READ_ONLY : 0;
        m->dl_tensor = dl;
        cap = PyCapsule_New(m, QK_CAPSULE_VERSIONED, qk_capsule_destructor);
        if (cap == NULL) m->deleter(m);
    } else {
        DLManagedTensor *m = (DLManagedTensor *)block;
        m->manager_ctx = self->storage;
        m->deleter = qk_export_deleter_legacy;
        m->dl_tensor = dl;
        cap = PyCapsule_New(m, QK_CAPSULE_LEGACY, qk_capsule_destructor);
        if (cap == NULL) m->deleter(m);
    }
    return cap;
}

static PyObject *tensor_dlpack_device(qk_tensor *self, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("(ii)", (int)self->v.raw_device_type, self->v.device_type == kDLCUDA ? (int)self->v.device_id : 0);
}

static PyObject *qk_int_tuple(const int64_t *v, int n) {
    PyObject *t = PyTuple_New(n);
    if (t == NULL) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (x == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

static PyObject *tensor_shape(qk_tensor *self, void *Py_UNUSED(c)) { return qk_int_tuple(self->v.shape, self->v.ndim); }
static PyObject *tensor_strides(qk_tensor *self, void *Py_UNUSED(c)) { return qk_int_tuple(self->v.strides, self->v.ndim); }
static PyObject *tensor_ndim(qk_tensor *self, void *Py_UNUSED(c)) { return PyLong_FromLong(self->v.ndim); }
static PyObject *tensor_dtype(qk_tensor *self, void *Py_UNUSED(c)) { return PyUnicode_FromString(qk_dtype_name(self->v.dtype)); }
static PyObject *tensor_data_ptr(qk_tensor *self, void *Py_UNUSED(c)) { return PyLong_FromVoidPtr(self->v.data); }
static PyObject *tensor_readonly(qk_tensor *self, void *Py_UNUSED(c)) { return PyBool_FromLong(self->v.readonly); }
static PyObject *tensor_device(qk_tensor *self, void *Py_UNUSED(c)) {
    char buf[64];
    qk_device_str(buf, sizeof buf, self->v.raw_device_type, self->v.device_id);
    return PyUnicode_FromString(buf);
}

static PyObject *tensor_repr(qk_tensor *self) {
    PyObject *shape = tensor_shape(self, NULL);
    if (shape == NULL) return NULL;
    char dev[64];
    qk_device_str(dev, sizeof dev, self->v.raw_device_type, self->v.device_id);
    PyObject *r = PyUnicode_FromFormat("qkernels.Tensor(shape=%R, dtype=%s, device=%s)", shape,
                                       qk_dtype_name(self->v.dtype), dev);
    Py_DECREF(shape);
    return r;
}

/* NumPy's array protocol for host tensors: a zero-copy view through DLPack (np.asarray(t)). */
static PyObject *tensor_array(qk_tensor *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"dtype", "copy", NULL};
    PyObject *a[2] = {NULL, NULL};
    if (qk_parse_args("Tensor.__array__", args, nargs, kwnames, names, 1, 0, a) < 0) return NULL;
    if (self->v.device_type != kDLCPU) {
        char dev[64];
        qk_device_str(dev, sizeof dev, self->v.device_type, self->v.device_id);
        PyErr_Format(PyExc_TypeError, "Tensor.__array__: the tensor is on %s; NumPy reads host memory only (hand it "
                     "to a GPU framework, e.g. torch.from_dlpack(t))", dev);
        return NULL;
    }
    PyObject *np = PyImport_ImportModule("numpy");
    if (np == NULL) return NULL;
    PyObject *arr = PyObject_CallMethod(np, "from_dlpack", "O", (PyObject *)self);
    Py_DECREF(np);
    if (arr == NULL) return NULL;
    int copy = 0;
    if (a[1] != NULL && a[1] != Py_None && (copy = PyObject_IsTrue(a[1])) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    if ((a[0] == NULL || a[0] == Py_None) && !copy) return arr;
    PyObject *dtype = a[0] != NULL && a[0] != Py_None ? Py_NewRef(a[0]) : PyObject_GetAttrString(arr, "dtype");
    PyObject *astype = dtype ? PyObject_GetAttrString(arr, "astype") : NULL, *r = NULL;
    if (astype) {
        PyObject *argv[2] = {dtype, copy ? Py_True : Py_False}, *kw = Py_BuildValue("(s)", "copy");
        r = kw ? PyObject_Vectorcall(astype, argv, 1, kw) : NULL;
        Py_XDECREF(kw);
        Py_DECREF(astype);
    }
    Py_XDECREF(dtype);
    Py_DECREF(arr);
    return r;
}

static PyMethodDef tensor_methods[] = {
    {"__array__", (PyCFunction)(void (*)(void))tensor_array, METH_FASTCALL | METH_KEYWORDS,
     "__array__(dtype=None, copy=None)\n--\n\nA NumPy view of a host tensor (np.asarray(t))."},
    {"__dlpack__", (PyCFunction)(void (*)(void))tensor_dlpack, METH_FASTCALL | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\n"
     "Export as a DLPack capsule: versioned when max_version >= (1, 0) is given, legacy otherwise. "
     "A CUDA consumer's stream is made to wait for this tensor's producing work (event, no device sync)."},
    {"__dlpack_device__", (PyCFunction)tensor_dlpack_device, METH_NOARGS,
     "__dlpack_device__()\n--\n\n(device_type, device_id) in DLPack's numbering."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef tensor_getset[] = {
    {"shape", (getter)tensor_shape, NULL, "tuple of sizes", NULL},
    {"strides", (getter)tensor_strides, NULL, "tuple of strides, in elements", NULL},
    {"ndim", (getter)tensor_ndim, NULL, "number of dimensions", NULL},
    {"dtype", (getter)tensor_dtype, NULL, "element type name, e.g. 'float32'", NULL},
    {"device", (getter)tensor_device, NULL, "'cpu' or 'cuda:N'", NULL},
    {"data_ptr", (getter)tensor_data_ptr, NULL, "address of the first element", NULL},
    {"readonly", (getter)tensor_readonly, NULL, "True when imported from a read-only producer", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot tensor_slots[] = {
    {Py_tp_dealloc, tensor_dealloc},
    {Py_tp_repr, tensor_repr},
    {Py_tp_methods, tensor_methods},
    {Py_tp_getset, tensor_getset},
    {Py_tp_doc, "A tensor produced by qkernels; hand it to any framework with from_dlpack (zero-copy)."},
    {0, NULL},
};

static PyType_Spec tensor_spec = {
    .name = "qkernels.Tensor",
    .basicsize = sizeof(qk_tensor),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = tensor_slots,
};

int qk_tensor_type_init(PyObject *module, qk_state *st) {
    st->tensor_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &tensor_spec, NULL);
    if (st->tensor_type == NULL) return -1;
    return PyModule_AddObjectRef(module, "Tensor", (PyObject *)st->tensor_type);
}
