/* qkernels._C: module definition (multi-phase init, module state) and the small utilities the
 * Python layer needs besides the ops. */
#define _GNU_SOURCE /* dladdr */
#include "qk.h"
#include "cpu/cpu.h"

#include <dlfcn.h>

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int qk_env_flag(const char *name) {
    const char *v = getenv(name);
    return v && *v && strcmp(v, "0") != 0;
}

/* describe(x) -> (device_kind << 8) | dtype, the dispatcher's cache key; -1 for non-tensors.
 * device_kind: 1 cpu, 2 cuda.  dtype: qk_dtype, or 255 when qkernels does not know it. */
static PyObject *qk_describe(PyObject *module, PyObject *obj) {
    qk_state *st = qk_get_state(module);
    int device_kind = -1, dtype = 255;
    if (qk_is_tensor(st, obj)) {
        qk_view v;
        qk_tensor_fill_view(obj, &v);
        device_kind = v.device_type == kDLCUDA ? 2 : 1;
        dtype = v.dtype;
    } else {
        /* A DLTensor read without taking it: an unconsumed capsule's, or the exchange API's. */
        const DLTensor *t = qk_capsule_peek(obj);
        DLTensor exported;
        const DLPackExchangeAPI *api = t == NULL && st->use_exchange_api ? qk_exchange_api(st, Py_TYPE(obj)) : NULL;
        if (api) {
            if (api->dltensor_from_py_object_no_sync(obj, &exported) != 0) {
                PyErr_Clear();
                return PyLong_FromLong(-1);
            }
            t = &exported;
        }
        if (t) {
            const int dt = t->device.device_type;
            device_kind = (dt == kDLCUDA || dt == kDLCUDAManaged) ? 2 : 1;
            const int k = t->dtype.lanes == 1 ? qk_dtype_from_dl(t->dtype) : -1;
            if (k >= 0) dtype = k;
        } else {
            PyObject *dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
            if (dev == NULL || !PyTuple_Check(dev) || PyTuple_GET_SIZE(dev) < 1) {
                Py_XDECREF(dev);
                PyErr_Clear();
                return PyLong_FromLong(-1);
            }
            long dt = PyLong_AsLong(PyTuple_GET_ITEM(dev, 0));
            Py_DECREF(dev);
            PyErr_Clear();
            device_kind = (dt == kDLCUDA || dt == kDLCUDAManaged) ? 2 : 1;
            PyObject *d = PyObject_GetAttrString(obj, "dtype");
            PyObject *s = d ? PyObject_Str(d) : NULL;
            const char *name = s ? PyUnicode_AsUTF8(s) : NULL;
            if (name) {
                if (strncmp(name, "torch.", 6) == 0) name += 6;
                int k = qk_dtype_from_name(name);
                if (k >= 0) dtype = k;
            }
            Py_XDECREF(s);
            Py_XDECREF(d);
            PyErr_Clear();
        }
    }
    return PyLong_FromLong((long)(device_kind << 8) | dtype);
}

static PyObject *qk_from_dlpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"x", "stream", NULL};
    PyObject *a[2] = {NULL, NULL};
    if (qk_parse_args("from_dlpack", args, nargs, kwnames, names, 1, 1, a) < 0) return NULL;
    qk_state *st = qk_get_state(module);
    void *stream;
    int given;
    if (qk_stream_arg("from_dlpack", a[1], &stream, &given) < 0) return NULL;
    if (qk_is_tensor(st, a[0])) return Py_NewRef(a[0]);
    /* Always through a capsule: a Tensor must own a reference to the producer's memory. */
    qk_view v;
    if (qk_import_ex(st, a[0], "from_dlpack", "x", stream, 1, &v) < 0) return NULL;
    PyObject *t = qk_tensor_from_view(st, &v);
    qk_views_release(&v, 1);
    return t;
}

static PyObject *qk_cuda_info(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    qk_state *st = qk_get_state(module);
    const qk_cuda_api *api = qk_cuda_try_load(st);
    PyObject *devices = PyList_New(0);
    if (devices == NULL) return NULL;
    int runtime = 0, driver = 0;
    if (api) {
        int n = 0;
        api->runtime_version(&runtime);
        api->driver_version(&driver);
        api->device_count(&n);
        for (int i = 0; i < n; i++) {
            char name[256] = "";
            int cc = 0, sms = 0;
            size_t mem = 0;
            if (api->device_props(i, name, sizeof name, &cc, &sms, &mem)) continue;
            PyObject *d = Py_BuildValue("{s:i,s:s,s:(ii),s:i,s:K}", "index", i, "name", name, "capability", cc / 10,
                                        cc % 10, "multiprocessors", sms, "memory", (unsigned long long)mem);
            if (d == NULL || PyList_Append(devices, d) < 0) {
                Py_XDECREF(d);
                Py_DECREF(devices);
                return NULL;
            }
            Py_DECREF(d);
        }
    }
    PyObject *r = Py_BuildValue("{s:O,s:O,s:s,s:s,s:i,s:i,s:N,s:O}", "built", st->cuda_path != Py_None ? Py_True : Py_False,
                                "available", api ? Py_True : Py_False, "reason", qk_cuda_unavailable_reason(),
                                "archs", api ? api->archs : "", "runtime_version", runtime, "driver_version", driver,
                                "devices", devices, "library", st->cuda_path);
    return r;
}

static PyObject *qk_configure(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"check_indices", "use_exchange_api", "num_threads", NULL};
    PyObject *a[3] = {NULL, NULL, NULL};
    if (qk_parse_args("_configure", args, nargs, kwnames, names, 0, 0, a) < 0) return NULL;
    qk_state *st = qk_get_state(module);
    PyObject *old = Py_BuildValue("{s:O,s:O,s:i}", "check_indices", st->check_indices ? Py_True : Py_False,
                                  "use_exchange_api", st->use_exchange_api ? Py_True : Py_False, "num_threads",
                                  st->num_threads);
    if (old == NULL) return NULL;
    int v;
    if (a[0] && a[0] != Py_None) {
        if ((v = PyObject_IsTrue(a[0])) < 0) goto fail;
        st->check_indices = v;
    }
    if (a[1] && a[1] != Py_None) {
        if ((v = PyObject_IsTrue(a[1])) < 0) goto fail;
        st->use_exchange_api = v;
    }
    if (a[2] && a[2] != Py_None) {
        long n = PyLong_AsLong(a[2]);
        if (n == -1 && PyErr_Occurred()) goto fail;
        if (n < 1) {
            PyErr_SetString(PyExc_ValueError, "_configure: num_threads must be >= 1");
            goto fail;
        }
        st->num_threads = (int)n;
    }

    return old;
fail:
    Py_DECREF(old);
    return NULL;
}

static PyObject *qk_parallel_selftest_py(PyObject *module, PyObject *args) {
    (void)module;
    int jobs, few, many;
    if (!PyArg_ParseTuple(args, "iii:_parallel_selftest", &jobs, &few, &many)) return NULL;
    if (jobs < 1 || few < 1 || many < 1 || few > 64 || many > 64) {
        PyErr_Format(PyExc_ValueError, "_parallel_selftest: expected jobs >= 1 and thread counts in [1, 64], got %d, %d, %d",
                     jobs, few, many);
        return NULL;
    }
    int64_t bad = 0, late = 0;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = qk_parallel_selftest(jobs, few, many, &bad, &late);
    Py_END_ALLOW_THREADS
    if (qk_raise_status("_parallel_selftest", status) < 0) return NULL;
    return Py_BuildValue("(LL)", (long long)bad, (long long)late);
}

static PyObject *qk_live_storages(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    (void)module;
    return PyLong_FromLong(qk_tensor_live_storages());
}

PyObject *qk_cpu_isa_py(PyObject *module, PyObject *Py_UNUSED(ignored)); /* csrc/ops/linear.c */

static PyMethodDef qk_methods[] = {
#define QK_METHODS(op, launcher, family, deciding)                                                  \
    {#op "_raw", (PyCFunction)(void (*)(void))qk_op_##op, METH_FASTCALL | METH_KEYWORDS, qk_raw_doc_##op}, \
    {#op, (PyCFunction)(void (*)(void))qk_public_##op, METH_FASTCALL | METH_KEYWORDS, qk_doc_##op},
    QK_OPS(QK_METHODS)
#undef QK_METHODS
    {"_install_dispatch", (PyCFunction)(void (*)(void))qk_install_dispatch, METH_FASTCALL | METH_KEYWORDS,
     "_install_dispatch(context, direct_plans, direct_types, fallbacks)\n--\n\n"
     "Hand the Python dispatcher's state to the public entry points (called by qkernels at import)."},
    {"_direct_key", (PyCFunction)(void (*)(void))qk_direct_key, METH_FASTCALL | METH_KEYWORDS,
     "_direct_key(x, has_mask)\n--\n\nThe key under which the dispatcher records a direct plan for x (-1: none)."},
    {"from_dlpack", (PyCFunction)(void (*)(void))qk_from_dlpack, METH_FASTCALL | METH_KEYWORDS,
     "from_dlpack(x, *, stream=None)\n--\n\nA zero-copy qkernels.Tensor viewing any DLPack producer or capsule."},
    {"describe", (PyCFunction)qk_describe, METH_O,
     "describe(x)\n--\n\n(device_kind << 8) | dtype code of a tensor, for the dispatcher; -1 if x is not one."},
    {"cuda_info", (PyCFunction)qk_cuda_info, METH_NOARGS,
     "cuda_info()\n--\n\nWhether the CUDA kernels were built and load, why not, and the devices."},
    {"_configure", (PyCFunction)(void (*)(void))qk_configure, METH_FASTCALL | METH_KEYWORDS,
     "_configure(*, check_indices=None, use_exchange_api=None, num_threads=None)\n--\n\n"
     "Change debug settings (the first and last normally from QKERNELS_CHECK and QKERNELS_NUM_THREADS); "
     "returns the previous ones."},
    {"_parallel_selftest", (PyCFunction)qk_parallel_selftest_py, METH_VARARGS,
     "_parallel_selftest(jobs, few, many)\n--\n\n(shares that ran other than once, shares still running after "
     "their call returned) over `jobs` CPU-pool calls alternating between `few` and `many` threads (for tests)."},
    {"_cpu_isa", (PyCFunction)qk_cpu_isa_py, METH_NOARGS,
     "_cpu_isa()\n--\n\nThe best instruction-set level of the cpu linear and swiglu here (tests)."},
    {"_live_storages", (PyCFunction)qk_live_storages, METH_NOARGS,
     "_live_storages()\n--\n\nNumber of qkernels.Tensor memory blocks not yet freed (for leak tests)."},
    {"_jax_handlers", (PyCFunction)qk_jax_handlers, METH_O,
     "_jax_handlers(cuda)\n--\n\n{op: (cpu handler, cuda handler or None, command-buffer compatible)}: the XLA FFI "
     "handlers as capsules for jax.ffi.register_ffi_target (csrc/ffi/handlers.c)."},
    {"_jax_scratch_bytes", (PyCFunction)qk_jax_scratch_bytes, METH_VARARGS,
     "_jax_scratch_bytes(op, device, operands, results, attrs, aliases)\n--\n\n(requested, result_bytes): the "
     "scratch op's CUDA handler asks for with these (dtype name, shape) operands and results, found by a dry run of "
     "the handler on CUDA device `device`, and the size of the uint8 scratch result qkernels.jax gives it."},
    {NULL, NULL, 0, NULL},
};

/* The CUDA shared object sits beside this module's own file, found through the loader (module
 * attributes such as __file__ are not set yet while the module executes). */
static PyObject *qk_find_cuda_library(void) {
    Dl_info info;
    if (!dladdr((void *)qk_find_cuda_library, &info) || info.dli_fname == NULL) Py_RETURN_NONE;
    const char *f = info.dli_fname, *slash = strrchr(f, '/');
    char path[4096];
    int n = slash ? snprintf(path, sizeof path, "%.*s/_qkernels_cuda.so", (int)(slash - f), f)
                  : snprintf(path, sizeof path, "./_qkernels_cuda.so");
    if (n <= 0 || n >= (int)sizeof path || access(path, R_OK) != 0) Py_RETURN_NONE;
    return PyUnicode_DecodeFSDefault(path);
}

static int qk_dict_set_pair(PyObject *dict, const char *key, const char *family, int position) {
    PyObject *value = Py_BuildValue("(si)", family, position);
    if (value == NULL) return -1;
    int r = PyDict_SetItemString(dict, key, value);
    Py_DECREF(value);
    return r;
}

static int qk_exec(PyObject *module) {
    qk_state *st = qk_get_state(module);
    if (qk_tensor_type_init(module, st) < 0) return -1;
    st->str_dlpack = PyUnicode_InternFromString("__dlpack__");
    st->str_dlpack_device = PyUnicode_InternFromString("__dlpack_device__");
    st->str_exchange_api = PyUnicode_InternFromString("__dlpack_c_exchange_api__");
    st->str_requires_grad = PyUnicode_InternFromString("requires_grad");
    st->str_is_neg = PyUnicode_InternFromString("is_neg");
    st->str_detach = PyUnicode_InternFromString("detach");
    st->str_training = PyUnicode_InternFromString("training");
    st->grad_required = PyErr_NewExceptionWithDoc(
        "qkernels._C.GradRequiredError",
        "A raw op was given a tensor that requires grad under grad mode; the public op records the gradient.",
        PyExc_RuntimeError, NULL);
    if (!st->str_training || !st->grad_required || PyModule_AddObjectRef(module, "GradRequiredError",
                                                                         st->grad_required) < 0)
        return -1;
    st->kw_versioned = Py_BuildValue("(ss)", "stream", "max_version");
    st->kw_legacy = Py_BuildValue("(s)", "stream");
    st->max_version = Py_BuildValue("(ii)", QK_DLPACK_MAJOR, QK_DLPACK_MINOR);
    if (!st->str_dlpack || !st->str_dlpack_device || !st->str_exchange_api || !st->str_requires_grad || !st->str_is_neg ||
        !st->str_detach || !st->kw_versioned || !st->kw_legacy ||
        !st->max_version)
        return -1;
    st->use_exchange_api = 1; /* _configure(use_exchange_api=False) turns it off, for tests */
    st->check_indices = qk_env_flag("QKERNELS_CHECK");
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    st->num_threads = cores > 0 ? (int)cores : 1;
    const char *nt = getenv("QKERNELS_NUM_THREADS");
    if (nt && *nt) {
        char *end;
        long n = strtol(nt, &end, 10);
        if (*end != 0 || n < 1 || n > 4096) {
            PyErr_Format(PyExc_ValueError, "QKERNELS_NUM_THREADS must be a whole number of CPU threads from 1 to "
                         "4096, got '%s'", nt);
            return -1;
        }
        st->num_threads = (int)n;
    }
    st->cuda_path = qk_find_cuda_library();
    if (st->cuda_path == NULL) return -1;
    if (PyModule_AddIntConstant(module, "DLPACK_MAJOR", QK_DLPACK_MAJOR) < 0) return -1;
    /* The op table for the Python layer: op -> (family, position of the deciding argument). */
    PyObject *ops = PyDict_New();
    if (ops == NULL) return -1;
#define QK_OP_ENTRY(op, launcher, family, deciding)                          \
    if (qk_dict_set_pair(ops, #op, #family, deciding) < 0) {                 \
        Py_DECREF(ops);                                                       \
        return -1;                                                            \
    }
    QK_OPS(QK_OP_ENTRY)
#undef QK_OP_ENTRY
    int added = PyModule_AddObjectRef(module, "OPS", ops);
    Py_DECREF(ops);
    if (added < 0) return -1;
    return PyModule_AddObjectRef(module, "CUDA_LIBRARY", st->cuda_path);
}

/* Every reference qk_state owns besides api_types, in one list so that traverse and clear agree
 * (visiting the strings and tuples too is harmless: the collector skips what it does not track). */
#define QK_STATE_OBJECTS(X)                                                                                \
    X(tensor_type) X(str_dlpack) X(str_dlpack_device) X(str_exchange_api) X(str_requires_grad) X(str_is_neg) \
    X(str_detach) X(grad_enabled) X(bump_version) X(grad_required) X(str_training) X(kw_versioned)           \
    X(kw_legacy) X(max_version) X(cuda_path) X(dispatch_ctx) X(direct_plans) X(direct_types) X(fallbacks)

static int qk_traverse(PyObject *module, visitproc visit, void *arg) {
    qk_state *st = qk_get_state(module);
#define QK_VISIT(member) Py_VISIT(st->member);
    QK_STATE_OBJECTS(QK_VISIT)
#undef QK_VISIT
    for (int i = 0; i < st->num_api_types; i++) {
        Py_VISIT(st->api_types[i]);
        Py_VISIT(st->requires_grad_desc[i]);
        Py_VISIT(st->is_neg_desc[i]);
    }
    return 0;
}

static int qk_clear(PyObject *module) {
    qk_state *st = qk_get_state(module);
#define QK_CLEAR(member) Py_CLEAR(st->member);
    QK_STATE_OBJECTS(QK_CLEAR)
#undef QK_CLEAR
    for (int i = 0; i < st->num_api_types; i++) {
        Py_CLEAR(st->api_types[i]);
        Py_CLEAR(st->requires_grad_desc[i]);
        Py_CLEAR(st->is_neg_desc[i]);
    }
    st->num_api_types = 0;
    return 0;
}

static void qk_free(void *module) { qk_clear(module); }

static PyModuleDef_Slot qk_slots[] = {
    {Py_mod_exec, qk_exec},
    {0, NULL},
};

static struct PyModuleDef qk_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "qkernels._C",
    .m_doc = "qkernels' C extension: ops over DLPack tensors, CPU kernels in C, CUDA kernels loaded on demand.",
    .m_size = sizeof(qk_state),
    .m_methods = qk_methods,
    .m_slots = qk_slots,
    .m_traverse = qk_traverse,
    .m_clear = qk_clear,
    .m_free = qk_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&qk_module); }
