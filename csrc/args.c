/* Vectorcall argument parsing and the shape/dtype checks every op shares.  Every error names
 * the function and the argument. */
#include "qk.h"

#include <math.h>
#include <stdarg.h>
#include <string.h>

int qk_parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                  const char *const *names, int npositional, int nrequired, PyObject **out) {
    int nnames = 0;
    while (names[nnames]) nnames++;
    if (nargs > npositional) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional arguments (%zd given)", fname, npositional,
                     nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) out[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int found = -1;
        for (int j = 0; j < nnames; j++) {
            if (PyUnicode_CompareWithASCIIString(key, names[j]) == 0) {
                found = j;
                break;
            }
        }
        if (found < 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fname, key);
            return -1;
        }
        if (out[found]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname, names[found]);
            return -1;
        }
        out[found] = args[nargs + k];
    }
    for (int j = 0; j < nrequired; j++) {
        if (out[j] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s' (pos %d)", fname, names[j], j + 1);
            return -1;
        }
    }
    return 0;
}

int qk_stream_arg(const char *fname, PyObject *obj, void **stream, int *given) {
    *stream = NULL;
    *given = 0;
    if (obj == NULL || obj == Py_None) return 0;
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: stream must be an int CUDA stream handle or None, got %.200s", fname,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    *stream = PyLong_AsVoidPtr(obj);
    if (*stream == NULL && PyErr_Occurred()) return -1;
    *given = 1;
    return 0;
}

int qk_variant_arg(const char *fname, const char *arg, PyObject *obj, const char *const *names, int n, int *value) {
    *value = 0;
    if (obj == NULL || obj == Py_None) return 0;
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be a str, got %.200s", fname, arg, Py_TYPE(obj)->tp_name);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (names[i] && PyUnicode_CompareWithASCIIString(obj, names[i]) == 0) {
            *value = i;
            return 0;
        }
    }
    char list[256];
    size_t k = 0;
    for (int i = 0; i < n && k < sizeof list; i++)
        if (names[i]) k += snprintf(list + k, sizeof list - k, "%s'%s'", k ? ", " : "", names[i]);
    PyErr_Format(PyExc_ValueError, "%s: %s must be one of %s, got %R", fname, arg, list, obj);
    return -1;
}

int qk_tuning_int_arg(const char *fname, const char *arg, PyObject *obj, int max, int pow2, int *value) {
    *value = 0;
    if (obj == NULL || obj == Py_None) return 0;
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be an int, got %.200s", fname, arg, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow;
    const long v = PyLong_AsLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v < 0 || v > max || (pow2 && (v & (v - 1)))) {
        if (pow2)
            PyErr_Format(PyExc_ValueError, "%s: %s must be 0 (automatic) or a power of two up to %d, got %R", fname,
                         arg, max, obj);
        else
            PyErr_Format(PyExc_ValueError, "%s: %s must be in [0, %d] (0: automatic), got %R", fname, arg, max, obj);
        return -1;
    }
    *value = (int)v;
    return 0;
}

int qk_bool_arg(const char *fname, const char *arg, PyObject *obj, int dflt, int *value) {
    *value = obj ? PyObject_IsTrue(obj) : dflt;
    if (*value >= 0) return 0;
    PyErr_Clear(); /* e.g. a NumPy array of several elements: name the op and the argument */
    PyErr_Format(PyExc_TypeError, "%s: %s must be a bool, got %.200s", fname, arg, Py_TYPE(obj)->tp_name);
    return -1;
}

int qk_float_arg(const char *fname, const char *arg, PyObject *obj, double dflt, double *value) {
    *value = dflt;
    if (obj == NULL || obj == Py_None) return 0;
    *value = PyFloat_AsDouble(obj);
    if (*value == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: %s must be a float, got %.200s", fname, arg, Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

int qk_eps_check(const char *fname, double eps, PyObject *obj) {
    if (eps >= 0.0 && !isinf((float)eps)) return 0;
    PyErr_Format(PyExc_ValueError, "%s: eps must be a finite value >= 0, got %R", fname, obj);
    return -1;
}

void qk_shape_str(char *buf, size_t n, const int64_t *shape, int ndim) {
    size_t k = 0;
    k += snprintf(buf + k, n - k, "[");
    for (int i = 0; i < ndim && k < n; i++) k += snprintf(buf + k, n - k, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (k < n) snprintf(buf + k, n - k, "]");
}

int qk_check_ndim(const char *op, const char *arg, const qk_view *v, int ndim, const char *layout_fmt, ...) {
    if (v->ndim == ndim) return 0;
    char got[160], layout[192];
    va_list ap;
    va_start(ap, layout_fmt);
    vsnprintf(layout, sizeof layout, layout_fmt, ap);
    va_end(ap);
    qk_shape_str(got, sizeof got, v->shape, v->ndim);
    PyErr_Format(PyExc_ValueError, "%s: %s must have %d dimensions %s, got shape %s", op, arg, ndim, layout, got);
    return -1;
}

int qk_check_dim(const char *op, const char *arg, const qk_view *v, int dim, int64_t expected, const char *layout_fmt,
                 ...) {
    if (v->shape[dim] == expected) return 0;
    char got[160], layout[192];
    va_list ap;
    va_start(ap, layout_fmt);
    vsnprintf(layout, sizeof layout, layout_fmt, ap);
    va_end(ap);
    qk_shape_str(got, sizeof got, v->shape, v->ndim);
    PyErr_Format(PyExc_ValueError, "%s: %s must have shape %s with size %lld in dimension %d, got %s", op, arg, layout,
                 (long long)expected, dim, got);
    return -1;
}

int qk_check_dtype_float(const char *op, const char *arg, const qk_view *v) {
    const int cuda = v->device_type == kDLCUDA;
    if (v->dtype == QK_F32 || (cuda && (v->dtype == QK_F16 || v->dtype == QK_BF16))) return 0;
    PyErr_Format(PyExc_TypeError, "%s: %s must be float32%s, got %s", op, arg, cuda ? ", float16 or bfloat16" : "",
                 qk_dtype_name(v->dtype));
    return -1;
}

int qk_check_same_dtype(const char *op, const char *arg, const qk_view *v, const char *owner, const qk_view *ref) {
    if (v->dtype == ref->dtype) return 0;
    PyErr_Format(PyExc_TypeError, "%s: %s must have %s dtype (%s), got %s", op, arg, owner, qk_dtype_name(ref->dtype),
                 qk_dtype_name(v->dtype));
    return -1;
}

int qk_check_dtype_index(const char *op, const char *arg, const qk_view *v) {
    if (v->dtype == QK_I32 || v->dtype == QK_I64) return 0;
    PyErr_Format(PyExc_TypeError, "%s: %s must be int32 or int64, got %s", op, arg, qk_dtype_name(v->dtype));
    return -1;
}

int qk_check_dtype_llm(const char *op, const char *arg, const qk_view *v) {
    const int cuda = v->device_type == kDLCUDA;
    if (v->dtype == QK_BF16 || v->dtype == QK_F16 || (!cuda && v->dtype == QK_F32)) return 0;
    PyErr_Format(PyExc_TypeError, "%s: %s must be bfloat16 or float16%s, got %s", op, arg,
                 cuda ? " on cuda (float32 runs on the cpu backend)" : " or float32", qk_dtype_name(v->dtype));
    return -1;
}

int qk_check_inner_unit(const char *op, const char *arg, const qk_view *v) {
    const int d = v->ndim - 1;
    if (d < 0 || v->shape[d] <= 1 || v->strides[d] == 1) return 0;
    for (int i = 0; i < v->ndim; i++)
        if (v->shape[i] == 0) return 0; /* an empty tensor's strides are arbitrary (NumPy exports 0s) */
    PyErr_Format(PyExc_ValueError, "%s: %s must be unit-stride in its last dimension, got stride %lld; pass a "
                 "contiguous copy", op, arg, (long long)v->strides[d]);
    return -1;
}

long long qk_num_graphs_arg(const char *fname, PyObject *obj, int64_t scratch_bytes) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: num_graphs must be an int, got %.200s", fname, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow = 0;
    const long long G = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (G == -1 && PyErr_Occurred()) return -1;
    if (overflow || G < 1) {
        PyErr_Format(PyExc_ValueError, "%s: num_graphs must be between 1 and 2^63 - 1, got %R", fname, obj);
        return -1;
    }
    if (G > INT64_MAX / scratch_bytes) { /* the kernels keep a few words per graph */
        PyErr_Format(PyExc_MemoryError, "%s: num_graphs = %lld needs more than 2^63 bytes of scratch", fname, G);
        return -1;
    }
    return G;
}

long long qk_count_arg(const char *fname, const char *arg, PyObject *obj, long long max) {
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be an int, got %.200s", fname, arg, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow = 0;
    const long long n = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (n == -1 && PyErr_Occurred()) return -1;
    if (overflow || n < 0 || n > max) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be between 0 and %lld, got %R", fname, arg, max, obj);
        return -1;
    }
    return n;
}
