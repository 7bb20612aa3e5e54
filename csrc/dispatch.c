/* The public op entry points (qkernels.<op>) are C functions.  Python decides, C executes: a
 * call the Python dispatcher has already decided to run on our kernels with the caller's tensors
 * as they are (no backend=, no use_backend context, every tensor of a direct type) goes straight
 * to the op; anything else goes to the Python dispatcher (qkernels/_dispatch.py, which owns every
 * decision and records the direct ones in direct_plans).  docs/dispatch.md gives the figures. */
#include "qk.h"

#include <string.h>

PyObject *qk_install_dispatch(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"context", "direct_plans", "direct_types", "fallbacks", NULL};
    PyObject *a[4] = {NULL, NULL, NULL, NULL};
    if (qk_parse_args("_install_dispatch", args, nargs, kwnames, names, 4, 4, a) < 0) return NULL;
    if (!PyContextVar_CheckExact(a[0]) || !PyDict_CheckExact(a[1]) || !PyAnySet_CheckExact(a[2]) ||
        !PyDict_CheckExact(a[3])) {
        PyErr_SetString(PyExc_TypeError, "_install_dispatch(context: ContextVar, direct_plans: dict, direct_types: set, "
                                         "fallbacks: dict)");
        return NULL;
    }
    qk_state *st = qk_get_state(module);
    Py_XSETREF(st->dispatch_ctx, Py_NewRef(a[0]));
    Py_XSETREF(st->direct_plans, Py_NewRef(a[1]));
    Py_XSETREF(st->direct_types, Py_NewRef(a[2]));
    Py_XSETREF(st->fallbacks, Py_NewRef(a[3]));
    Py_RETURN_NONE;
}

/* The key of a direct plan from the deciding tensor's DLTensor: what the dispatcher's predicates read
 * from a call beyond the op (device, dtype, last dimension, mask or not). */
static PyObject *qk_direct_key_from(const DLTensor *t, int has_mask) {
    const int dt = t->device.device_type;
    const long long device_kind = (dt == kDLCUDA || dt == kDLCUDAManaged) ? 2 : 1;
    const long long last = t->ndim > 0 && t->shape[t->ndim - 1] < (1LL << 40) ? t->shape[t->ndim - 1] : -1;
    const long long code = (long long)t->dtype.code | (long long)t->dtype.bits << 8 | (long long)t->dtype.lanes << 16;
    return PyLong_FromLongLong(((last + 1) << 24 | code) << 3 | device_kind << 1 | has_mask);
}

/* The key of x; NULL without an exception: not a tensor the exchange API reads. */
static PyObject *qk_direct_key_of(qk_state *st, PyObject *x, int has_mask) {
    const DLPackExchangeAPI *api = st->use_exchange_api ? qk_exchange_api(st, Py_TYPE(x)) : NULL;
    DLTensor t;
    if (api == NULL || api->dltensor_from_py_object_no_sync(x, &t) != 0) {
        PyErr_Clear();
        return NULL;
    }
    return qk_direct_key_from(&t, has_mask);
}

PyObject *qk_direct_key(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"x", "has_mask", NULL};
    PyObject *a[2] = {NULL, NULL};
    if (qk_parse_args("_direct_key", args, nargs, kwnames, names, 2, 2, a) < 0) return NULL;
    int has_mask = PyObject_IsTrue(a[1]);
    if (has_mask < 0) return NULL;
    PyObject *key = qk_direct_key_of(qk_get_state(module), a[0], has_mask);
    return key ? key : PyLong_FromLong(-1);
}

/* A value that is not a tensor: it cannot mix frameworks. */
static inline int qk_is_scalar(PyObject *o) {
    return o == Py_None || PyLong_CheckExact(o) || PyFloat_CheckExact(o) || PyBool_Check(o);
}

/* 1: run directly; 0: ask the Python dispatcher; -1: error set. */
static int qk_direct(qk_state *st, PyObject *op_name, int deciding, PyObject *const *args, Py_ssize_t nargs,
                     PyObject *kwnames) {
    if (st->direct_plans == NULL || nargs <= deciding) return 0;
    PyObject *x = args[deciding];
    PyTypeObject *type = Py_TYPE(x);
    int r = PySet_Contains(st->direct_types, (PyObject *)type);
    if (r != 1) return r;
    int has_mask = 0;
    const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nargs + nkw; i++) {
        PyObject *o = args[i];
        if (i >= nargs) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, i - nargs);
            /* backend= and the raw ops' private keywords (_variant=, ...): the Python path decides or refuses */
            if (PyUnicode_CompareWithASCIIString(name, "backend") == 0 ||
                (PyUnicode_GET_LENGTH(name) > 0 && PyUnicode_READ_CHAR(name, 0) == '_'))
                return 0;
            if (o != Py_None && PyUnicode_CompareWithASCIIString(name, "mask") == 0) has_mask = 1;
            /* dropout: with torch tensors the Python path draws the seed from torch's generator */
            if (o == Py_True && PyUnicode_Compare(name, st->str_training) == 0) return 0;
        }
        if (Py_IS_TYPE(o, type) || qk_is_scalar(o)) continue;
        if ((r = PySet_Contains(st->direct_types, (PyObject *)Py_TYPE(o))) != 1) return r; /* mixed: Python checks */
    }
    PyObject *ctx;
    if (PyContextVar_Get(st->dispatch_ctx, NULL, &ctx) < 0) return -1;
    if (ctx == NULL) return 0;
    /* (mapping, token): token 0 means no use_backend(...) is active */
    r = PyTuple_Check(ctx) && PyTuple_GET_SIZE(ctx) == 2 && PyLong_Check(PyTuple_GET_ITEM(ctx, 1)) &&
        PyLong_AsLong(PyTuple_GET_ITEM(ctx, 1)) == 0;
    Py_DECREF(ctx);
    if (r != 1) return r;
    PyObject *plans = PyDict_GetItemWithError(st->direct_plans, op_name);
    if (plans == NULL || !PyDict_CheckExact(plans)) return PyErr_Occurred() ? -1 : 0;
    /* read once where the op imports x first (the deciding argument is its first): that import takes
     * this read (qk_direct_read) instead of reading x again */
    DLTensor t;
    if (qk_direct_read(st, x, deciding == 0, &t) < 0) return 0;
    PyObject *key = qk_direct_key_from(&t, has_mask);
    if (key == NULL) return -1;
    PyObject *hit = PyDict_GetItemWithError(plans, key);
    Py_DECREF(key);
    return hit == Py_True ? 1 : (PyErr_Occurred() ? -1 : 0);
}

static PyObject *qk_dispatch(PyObject *module, const char *op, PyObject *op_name, int deciding_arg,
                             PyObject *(*run)(PyObject *, PyObject *const *, Py_ssize_t, PyObject *),
                             PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    qk_state *st = qk_get_state(module);
    int direct = qk_direct(st, op_name, deciding_arg, args, nargs, kwnames);
    if (direct <= 0) qk_handoff_clear(); /* a read that no op call takes */
    if (direct < 0) return NULL;
    if (direct) {
        PyObject *r = run(module, args, nargs, kwnames);
        qk_handoff_clear(); /* the op may have failed before its first import */
        if (r != NULL || !PyErr_ExceptionMatches(st->grad_required)) return r;
        PyErr_Clear(); /* an input requires grad: the Python path records the op for autograd */
    }
    PyObject *fallback = st->fallbacks ? PyDict_GetItemWithError(st->fallbacks, op_name) : NULL;
    if (fallback == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_RuntimeError, "%s: the qkernels Python dispatcher is not installed; import qkernels", op);
        return NULL;
    }
    return PyObject_Vectorcall(fallback, args, nargs, kwnames);
}

/* One public entry per op: its name, the argument whose framework/device/dtype decide, the raw op. */
#define QK_PUBLIC(fn, name, deciding, raw)                                                                  \
    PyObject *fn(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {           \
        static PyObject *op_name; /* interned once, for the life of the process */                       \
        if (op_name == NULL && (op_name = PyUnicode_InternFromString(name)) == NULL) return NULL;         \
        return qk_dispatch(module, name, op_name, deciding, raw, args, nargs, kwnames);                   \
    }

#define QK_PUBLIC_OP(op, launcher, family, deciding) QK_PUBLIC(qk_public_##op, #op, deciding, qk_op_##op)
QK_OPS(QK_PUBLIC_OP)
#undef QK_PUBLIC_OP
