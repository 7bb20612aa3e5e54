/* Internal declarations of the C extension qkernels._C (pure C11, no CUDA headers). */
#ifndef QK_H
#define QK_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "dlpack.h"
#include "../kernels/qk_launch.h"

#define QK_MAX_DIMS 8
#define QK_MAX_API_TYPES 8

/* Per-module state (multi-phase init). */
typedef struct {
    PyTypeObject *tensor_type;
    PyObject *str_dlpack;        /* "__dlpack__" */
    PyObject *str_dlpack_device; /* "__dlpack_device__" */
    PyObject *str_exchange_api;  /* "__dlpack_c_exchange_api__" */
    PyObject *kw_versioned;      /* ("stream", "max_version") */
    PyObject *kw_legacy;         /* ("stream",) */
    PyObject *max_version;       /* (1, 1) */
    PyObject *str_requires_grad; /* "requires_grad" */
    PyObject *str_is_neg;        /* "is_neg" */
    PyObject *str_detach;        /* "detach" */
    /* Types seen by the importer: their __dlpack_c_exchange_api__ table (NULL: none) and whether
     * their tensors carry autograd state (torch). */
    PyTypeObject *api_types[QK_MAX_API_TYPES];
    const DLPackExchangeAPI *apis[QK_MAX_API_TYPES];
    unsigned char autograd[QK_MAX_API_TYPES];
    int num_api_types;
    PyObject *grad_enabled; /* torch.is_grad_enabled, found with the first autograd type */
    int use_exchange_api; /* QKERNELS_NO_EXCHANGE_API=1 turns the fast path off (tests) */
    int check_indices;    /* QKERNELS_CHECK=1: validate indices on cuda too */
    int num_threads;      /* CPU workers; QKERNELS_NUM_THREADS or the core count */
    PyObject *cuda_path;  /* the CUDA shared object beside this module, or None */
    /* The Python dispatcher's state, installed by qkernels/_dispatch.py (see dispatch.c). */
    PyObject *dispatch_ctx;    /* ContextVar holding (mapping, token) */
    PyObject *direct_ops;      /* dict op name -> bool */
    PyObject *direct_types;    /* set of tensor types */
    PyObject *fallbacks;       /* dict op name -> Python callable taking the public signature */
} qk_state;

/* A borrowed or owned view of one tensor argument, strides in elements. */
typedef struct {
    char *data;
    int32_t device_type; /* kDLCPU or kDLCUDA after classification */
    int32_t device_id;
    int32_t raw_device_type;
    int dtype;
    int ndim;
    int readonly;
    int64_t shape[QK_MAX_DIMS];
    int64_t strides[QK_MAX_DIMS];
    const DLPackExchangeAPI *api; /* set when imported through a framework's C exchange API */
    void *owner;                  /* DLManagedTensor[Versioned] to release, or NULL */
    int owner_versioned;
} qk_view;

/* dlpack.c */
const char *qk_dtype_name(int dtype);
size_t qk_dtype_size(int dtype);
int qk_dtype_from_name(const char *name);
DLDataType qk_dtype_to_dl(int dtype);
const DLPackExchangeAPI *qk_exchange_api(qk_state *st, PyTypeObject *type);
int qk_import(qk_state *st, PyObject *obj, const char *op, const char *arg, void *stream, qk_view *v);
/* via_capsule: always through __dlpack__ (a view that must own the producer's memory) */
int qk_import_ex(qk_state *st, PyObject *obj, const char *op, const char *arg, void *stream, int via_capsule,
                 qk_view *v);
int qk_import_capsule(PyObject *capsule, const char *op, const char *arg, qk_view *v);
void qk_view_release(qk_view *v);      /* any thread, no GIL needed */
void qk_views_release(qk_view *v, int n); /* GIL held; keeps a pending exception */
void qk_device_str(char *buf, size_t n, int device_type, int device_id);
/* numel and numel * itemsize of a shape, -1 when either overflows int64 (no exception set) */
int qk_nbytes(int ndim, const int64_t *shape, size_t itemsize, int64_t *numel, int64_t *bytes);
/* numel and the bytes from v's lowest to its highest element, -1 on overflow (no exception set) */
int qk_view_extent(const qk_view *v, size_t itemsize, int64_t *numel, int64_t *span);

/* tensor.c */
typedef struct qk_storage qk_storage;
int qk_tensor_type_init(PyObject *module, qk_state *st);
PyObject *qk_tensor_empty(qk_state *st, const char *op, int dtype, int ndim, const int64_t *shape, int device_type,
                          int device_id, void *stream);
PyObject *qk_tensor_from_view(qk_state *st, qk_view *v); /* takes over v's owner */
void qk_tensor_fill_view(PyObject *tensor, qk_view *v);
int qk_is_tensor(qk_state *st, PyObject *obj);
long qk_tensor_live_storages(void);

/* cuda.c: the lazily loaded CUDA shared object */
const qk_cuda_api *qk_cuda_try_load(qk_state *st); /* NULL without raising */
const qk_cuda_api *qk_cuda(qk_state *st, const char *op); /* NULL with RuntimeError */
const char *qk_cuda_unavailable_reason(void);
const qk_cuda_api *qk_cuda_loaded(void); /* whatever is loaded, for deleters */
int qk_raise_status(const char *op, int status);

/* args.c: fast-call argument parsing that names the function in every error */
int qk_parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                  const char *const *names, int npositional, int nrequired, PyObject **out);
void qk_shape_str(char *buf, size_t n, const int64_t *shape, int ndim);
int qk_stream_arg(const char *fname, PyObject *obj, void **stream, int *given);
/* The raw ops' private tuning keywords (kernels/qk_launch.h's variant fields; absent or None: 0, the
 * automatic choice).  A variant by name: names[i] (NULL: none) gives i; anything else raises
 * ValueError (a non-str TypeError) naming fname and arg. */
int qk_variant_arg(const char *fname, const char *arg, PyObject *obj, const char *const *names, int n, int *value);
/* An int in [0, max], with pow2 a power of two (or 0); else ValueError (a non-int TypeError). */
int qk_tuning_int_arg(const char *fname, const char *arg, PyObject *obj, int max, int pow2, int *value);
#define QK_COUNT(array) ((int)(sizeof(array) / sizeof *(array)))

/* launch.c: device selection, stream choice and output allocation shared by every op */
typedef struct {
    int32_t device_type, device_id;
    void *stream;
    int prev_device;
    int switched;
    const qk_cuda_api *cuda;
} qk_launch;

typedef struct {
    PyObject *result;              /* the object returned to Python */
    DLManagedTensorVersioned *mt;  /* allocated through a framework's exchange API */
    const DLPackExchangeAPI *api;
} qk_output;

int qk_same_device(const char *op, const qk_view *views, const char *const *names, int n);
int qk_launch_begin(qk_state *st, const char *op, const qk_view *first, void *stream, int stream_given,
                    qk_launch *l);
void qk_launch_end(qk_launch *l);
int qk_output_prepare(qk_state *st, const char *op, PyObject *out_obj, const qk_view *like, int dtype,
                      int ndim, const int64_t *shape, const qk_launch *l, qk_view *ov, qk_output *o);
PyObject *qk_output_finish(qk_output *o, qk_view *ov, int ok);
/* The common end of every op: restore the device, hand out (or drop) the output, release inputs. */
PyObject *qk_op_finish(qk_launch *l, int launched, qk_output *o, qk_view *ov, int ok, qk_view *in, int n_in);

/* Run an op's launcher where the data lives: the CUDA one on the launch stream, or the CPU one
 * with the GIL released. */
#define QK_RUN(status, l, cuda_launcher, cpu_launcher, args) \
    do {                                                      \
        if ((l)->device_type == kDLCUDA) {                    \
            (status) = (l)->cuda->cuda_launcher((args), (l)->stream); \
        } else {                                              \
            Py_BEGIN_ALLOW_THREADS                            \
            (status) = cpu_launcher((args), NULL);            \
            Py_END_ALLOW_THREADS                              \
        }                                                     \
    } while (0)

/* Shape/dtype checks raising ValueError/TypeError with the op and argument named. */
int qk_check_ndim(const char *op, const char *arg, const qk_view *v, int ndim, const char *layout);
int qk_check_dtype_index(const char *op, const char *arg, const qk_view *v);
/* float32 anywhere; float16/bfloat16 too on cuda (fp32 arithmetic) */
int qk_check_dtype_float(const char *op, const char *arg, const qk_view *v);
/* v's dtype equals ref's; owner names ref in the message, e.g. "x's" */
int qk_check_same_dtype(const char *op, const char *arg, const qk_view *v, const char *owner, const qk_view *ref);
int qk_check_dim(const char *op, const char *arg, const qk_view *v, int dim, int64_t expected,
                 const char *layout);
/* the LLM ops: bfloat16 or float16 anywhere, float32 too on cpu */
int qk_check_dtype_llm(const char *op, const char *arg, const qk_view *v);
/* the last dimension is unit-stride (or has at most one element) */
int qk_check_inner_unit(const char *op, const char *arg, const qk_view *v);

/* dispatch.c: the public entry points' zero-lookup path */
PyObject *qk_install_dispatch(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);

/* ops: the raw entry points (no dispatch); dispatch.c wraps each as the public one */
PyObject *qk_op_sparse_aggregate(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_op_edge_features(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_op_norm_residual(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_op_graph_bce(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_public_sparse_aggregate(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_public_edge_features(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_public_norm_residual(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_public_graph_bce(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_op_attn_decode(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_op_attn_paged_decode(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_public_attn_decode(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_public_attn_paged_decode(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_op_attn_prefill(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_op_attn_paged_prefill(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_public_attn_prefill(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_public_attn_paged_prefill(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_op_rotary(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_op_linear(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_op_swiglu(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_public_rotary(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_public_linear(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_public_swiglu(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);

/* Keep a pending exception across calls that may run Python code (3.12 deprecates PyErr_Fetch). */
#if PY_VERSION_HEX >= 0x030C0000
typedef PyObject *qk_saved_error;
static inline qk_saved_error qk_error_save(void) { return PyErr_GetRaisedException(); }
static inline void qk_error_restore(qk_saved_error e) { PyErr_SetRaisedException(e); }
/* The pending exception as one normalised object (NULL if none), cleared. */
static inline PyObject *qk_exception_take(void) { return PyErr_GetRaisedException(); }
static inline void qk_exception_raise(PyObject *exc) { PyErr_SetRaisedException(exc); }
#else
typedef struct {
    PyObject *type, *value, *tb;
} qk_saved_error;
static inline qk_saved_error qk_error_save(void) {
    qk_saved_error e;
    PyErr_Fetch(&e.type, &e.value, &e.tb);
    return e;
}
static inline void qk_error_restore(qk_saved_error e) { PyErr_Restore(e.type, e.value, e.tb); }
static inline PyObject *qk_exception_take(void) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL) return NULL;
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}
static inline void qk_exception_raise(PyObject *exc) {
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
}
#endif

static inline qk_state *qk_get_state(PyObject *module) { return (qk_state *)PyModule_GetState(module); }

#endif
