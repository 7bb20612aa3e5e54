/* Internal declarations of the C extension qkernels._C (pure C11, no CUDA headers). */
#ifndef QK_H
#define QK_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "dlpack.h"
#include "qkernels/launch.h"

#define QK_MAX_DIMS 8
#define QK_MAX_API_TYPES 8

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
    /* Types seen by the importer: their __dlpack_c_exchange_api__ table (NULL: none) and, where
     * their tensors carry autograd state (torch), the type's requires_grad and is_neg descriptors
     * (NULL: none), read per call without a lookup by name. */
    PyTypeObject *api_types[QK_MAX_API_TYPES];
    const DLPackExchangeAPI *apis[QK_MAX_API_TYPES];
    PyObject *requires_grad_desc[QK_MAX_API_TYPES];
    PyObject *is_neg_desc[QK_MAX_API_TYPES];
    int num_api_types;
    PyObject *grad_enabled; /* torch.is_grad_enabled, found with the first autograd type */
    PyObject *bump_version; /* torch's version-counter increment, found at the first torch out= */
    PyObject *grad_required; /* GradRequiredError: an input needs autograd, which a raw op cannot record */
    PyObject *str_training;  /* "training" */
    int use_exchange_api; /* 0: read torch through __dlpack__ too (tests, through _configure) */
    int check_indices;    /* QKERNELS_CHECK=1: validate indices on cuda too */
    int num_threads;      /* CPU workers; QKERNELS_NUM_THREADS or the core count */
    PyObject *cuda_path;  /* the CUDA shared object beside this module, or None */
    /* The Python dispatcher's state, installed by qkernels/_dispatch.py (see dispatch.c). */
    PyObject *dispatch_ctx;    /* ContextVar holding (mapping, token) */
    PyObject *direct_plans;    /* dict op name -> dict of direct keys (see dispatch.c) */
    PyObject *direct_types;    /* set of tensor types */
    PyObject *fallbacks;       /* dict op name -> Python callable taking the public signature */
} qk_state;


/* dlpack.c */
const char *qk_dtype_name(int dtype);
size_t qk_dtype_size(int dtype);
int qk_dtype_from_name(const char *name);
DLDataType qk_dtype_to_dl(int dtype);
int qk_dtype_from_dl(DLDataType t); /* -1: a dtype qkernels does not know */
const DLPackExchangeAPI *qk_exchange_api(qk_state *st, PyTypeObject *type);
int qk_import(qk_state *st, PyObject *obj, const char *op, const char *arg, void *stream, qk_view *v);
/* via_capsule: always through __dlpack__ (a view that must own the producer's memory) */
int qk_import_ex(qk_state *st, PyObject *obj, const char *op, const char *arg, void *stream, int via_capsule,
                 qk_view *v);
int qk_import_capsule(PyObject *capsule, const char *op, const char *arg, qk_view *v);
/* The direct path's read of its deciding tensor obj: the exchange API's DLTensor *t and, with keep,
 * first the autograd check the op's import does, the import kept for the op's first import when that
 * is of obj (kept per thread until then or qk_handoff_clear).  1: read and kept; 0: read, not kept (without keep, or the op's import
 * raises); -1: not read (no exchange API, torch cannot export it, or with keep it requires grad
 * under grad mode).  Never raises. */
int qk_direct_read(qk_state *st, PyObject *obj, int keep, DLTensor *t);
void qk_handoff_clear(void); /* drops a kept read that no import took */
/* The DLTensor inside an unconsumed DLPack capsule, without taking it; NULL for anything else. */
const DLTensor *qk_capsule_peek(PyObject *obj);
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
/* The raw ops' private tuning keywords (include/qkernels/launch.h's variant fields; absent or None: 0, the
 * automatic choice).  A variant by name: names[i] (NULL: none) gives i; anything else raises
 * ValueError (a non-str TypeError) naming fname and arg. */
int qk_variant_arg(const char *fname, const char *arg, PyObject *obj, const char *const *names, int n, int *value);
/* num_graphs=: an int in [1, 2^63 - 1] whose scratch of scratch_bytes per graph fits in 2^63 bytes (else
 * TypeError, ValueError or MemoryError naming fname); -1 with an exception. */
long long qk_num_graphs_arg(const char *fname, PyObject *obj, int64_t scratch_bytes);
/* A count argument: an int in [0, max] (TypeError / ValueError naming fname and arg), or -1 raised. */
long long qk_count_arg(const char *fname, const char *arg, PyObject *obj, long long max);
/* An int in [0, max], with pow2 a power of two (or 0); else ValueError (a non-int TypeError). */
int qk_tuning_int_arg(const char *fname, const char *arg, PyObject *obj, int max, int pow2, int *value);
/* A bool keyword: its truth (absent: dflt) in *value; where truth cannot be taken TypeError naming fname and arg. */
int qk_bool_arg(const char *fname, const char *arg, PyObject *obj, int dflt, int *value);
/* A float keyword (absent or None: dflt) in *value; TypeError naming fname and arg where it is not one. */
int qk_float_arg(const char *fname, const char *arg, PyObject *obj, double dflt, double *value);
/* eps (given as obj) finite and >= 0 in float32, where the kernels add it; else ValueError. */
int qk_eps_check(const char *fname, double eps, PyObject *obj);
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
    PyObject *bump_version;        /* set for an out= that autograd tracks: its version moves on success */
} qk_output;

int qk_same_device(const char *op, const qk_view *views, const char *const *names, int n);
/* plan= of the graph backward ops: 0 for None, 1 with *v imported (the caller releases it with its
 * inputs) when obj is an int32 vector of len elements, unit stride, on like's device; -1 raised
 * (TypeError for the dtype, ValueError for the shape, stride or device, naming op and `plan`). */
int qk_plan_arg(qk_state *st, PyObject *obj, const char *op, void *stream, int64_t len, const char *layout,
                const qk_view *like, qk_view *v);
/* qk_import of objs[0..n) as in[0..n) (names[i] in messages; *n_in counts the views to release), then
 * qk_same_device: -1 with the exception at the first failure. */
int qk_import_all(qk_state *st, const char *op, PyObject *const *objs, const char *const *names, int n, void *stream,
                  qk_view *in, int *n_in);
int qk_launch_begin(qk_state *st, const char *op, const qk_view *first, void *stream, int stream_given,
                    qk_launch *l);
void qk_launch_end(qk_launch *l);
/* torch._C._increment_version (borrowed) when obj's type is one autograd tracks, else NULL, no error:
 * an out= written behind autograd's back must move its version counter as torch's own out= does. */
PyObject *qk_version_bumper(qk_state *st, PyObject *obj);
int qk_output_prepare(qk_state *st, const char *op, PyObject *out_obj, const qk_view *like, int dtype,
                      int ndim, const int64_t *shape, const qk_launch *l, qk_view *ov, qk_output *o);
PyObject *qk_output_finish(qk_output *o, qk_view *ov, int ok);
/* A 0-d output of dtype at the start of a block of `bytes` device bytes, allocated through like's
 * exchange API (like->api must be set): the rest of the block is the launcher's scratch, freed with
 * the output.  -1 with MemoryError (or the framework's exception). */
int qk_output_block(const char *op, const qk_view *like, const qk_launch *l, int dtype, size_t bytes, qk_view *ov,
                    qk_output *o);
/* ValueError when out shares memory with one of the n inputs, unless bit i of in_place is set and
 * out is exactly input i (the op's supported in-place form).  Inputs with data == NULL are absent. */
int qk_out_overlap(const char *op, const qk_view *out, const qk_view *in, const char *const *names, int n,
                   unsigned in_place);
/* Whether two views on one device can touch a common byte. */
int qk_views_overlap(const qk_view *a, const qk_view *b);
/* The common end of every op: restore the device, hand out (or drop) the output, release inputs. */
PyObject *qk_op_finish(qk_launch *l, int launched, qk_output *o, qk_view *ov, int ok, qk_view *in, int n_in);
/* The same for an op with n_out outputs (o[i], ov[i], zero-initialised; one never prepared is None):
 * a tuple of them, or NULL with every output dropped when !ok. */
PyObject *qk_op_finish_many(qk_launch *l, int launched, qk_output *o, qk_view *ov, int n_out, int ok, qk_view *in,
                            int n_in);

/* QKERNELS_CHECK=1 on cuda: the first of the n indices idx[i * stride] (dtype) outside [0, hi), found
 * before a kernel follows them -> QK_E_INDEX with *bad_pos, *bad_value.  QK_OK unchecked (the CPU
 * launchers check as they read). */
int qk_index_check(const qk_state *st, const qk_launch *l, const void *idx, int dtype, int64_t n, int64_t stride,
                   int64_t hi, int64_t *bad_pos, int64_t *bad_value);
/* A graph op's status: 0 for QK_OK, else -1 with the exception; QK_E_INDEX with arg (not NULL) as
 * ValueError naming the graph id arg[bad_pos] outside [0, num_graphs). */
int qk_graph_status(const char *op, int status, const char *arg, int64_t bad_pos, int64_t bad_value,
                    int64_t num_graphs);

/* Run launcher `name` of QK_LAUNCHERS where the data lives: qk_<name>_cuda on the launch stream,
 * or qk_<name>_cpu with the GIL released. */
#define QK_RUN(status, l, name, args)                               \
    do {                                                            \
        if ((l)->device_type == kDLCUDA) {                          \
            (status) = (l)->cuda->name((args), (l)->stream);        \
        } else {                                                    \
            Py_BEGIN_ALLOW_THREADS                                  \
            (status) = qk_##name##_cpu((args), NULL);               \
            Py_END_ALLOW_THREADS                                    \
        }                                                           \
    } while (0)

/* QK_RUN for a graph op whose args hold n graph ids `ids` (args->index_dtype, at stride; NULL: none)
 * in [0, args->num_graphs): QKERNELS_CHECK's validation first on cuda, then the launcher when `run`;
 * ok = 1, or the exception raised (a bad id named as arg[i], as args->bad_pos/bad_value give it). */
#define QK_RUN_GRAPH_IDS(ok, st, l, name, args, op, run, arg, ids, n, stride)                                    \
    do {                                                                                                       \
        int status_ = (ids) ? qk_index_check(st, l, ids, (args)->index_dtype, n, stride, (args)->num_graphs,    \
                                             &(args)->bad_pos, &(args)->bad_value)                             \
                            : QK_OK;                                                                           \
        if (status_ == QK_OK && (run)) QK_RUN(status_, l, name, args);                                          \
        (ok) = qk_graph_status(op, status_, (ids) ? (arg) : NULL, (args)->bad_pos, (args)->bad_value,           \
                               (args)->num_graphs) == 0;                                                       \
    } while (0)

/* Shape/dtype checks raising ValueError/TypeError with the op and argument named.  The expected
 * layout of the shape checks is a printf format with its values, formatted only when the check
 * fails: the passing checks of every call cost no formatting. */
int qk_check_ndim(const char *op, const char *arg, const qk_view *v, int ndim, const char *layout_fmt, ...)
    __attribute__((format(printf, 5, 6)));
int qk_check_dtype_index(const char *op, const char *arg, const qk_view *v);
/* float32 anywhere; float16/bfloat16 too on cuda (fp32 arithmetic) */
int qk_check_dtype_float(const char *op, const char *arg, const qk_view *v);
/* v's dtype equals ref's; owner names ref in the message, e.g. "x's" */
int qk_check_same_dtype(const char *op, const char *arg, const qk_view *v, const char *owner, const qk_view *ref);
int qk_check_dim(const char *op, const char *arg, const qk_view *v, int dim, int64_t expected,
                 const char *layout_fmt, ...) __attribute__((format(printf, 6, 7)));
/* the LLM ops: bfloat16 or float16 anywhere, float32 too on cpu */
int qk_check_dtype_llm(const char *op, const char *arg, const qk_view *v);
/* the last dimension is unit-stride (or has at most one element) */
int qk_check_inner_unit(const char *op, const char *arg, const qk_view *v);

/* dispatch.c: the public entry points' zero-lookup path */
PyObject *qk_install_dispatch(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *qk_direct_key(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);

/* csrc/ffi/handlers.c (built where jaxlib's headers are found): the XLA FFI handlers for qkernels.jax */
PyObject *qk_jax_handlers(PyObject *module, PyObject *cuda);
PyObject *qk_jax_scratch_bytes(PyObject *module, PyObject *args);

/* csrc/ops/: each op's binding (its raw entry point, no dispatch) and docstrings; dispatch.c wraps
 * each as the public entry point. */
typedef PyObject *(*qk_fastcall)(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
#define QK_OP_DECLARE(op, launcher, family, deciding)                                                          \
    PyObject *qk_op_##op(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);     \
    PyObject *qk_public_##op(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames); \
    extern const char qk_doc_##op[], qk_raw_doc_##op[];
QK_OPS(QK_OP_DECLARE)
#undef QK_OP_DECLARE

/* An op's docstrings beside its binding: params is the signature without backend= (public) or
 * stream= (raw), which the two entry points add. */
#define QK_DOCS(op, params, body)                                                   \
    const char qk_doc_##op[] = #op "(" params ", backend=None)\n--\n\n" body;      \
    const char qk_raw_doc_##op[] = #op "_raw(" params ", stream=None)\n--\n\n" QK_RAW_DOC;

#define QK_RAW_DOC                                                                                         \
    "The op without dispatch: runs where the tensors live, on `stream` (default: the framework's current "  \
    "stream through the DLPack exchange API, else the legacy default stream); returns the framework's "    \
    "tensor when it publishes an exchange API, else a qkernels.Tensor."
#define QK_GRAPH_DOC                                                                                       \
    "float32 on cpu and cuda, float16/bfloat16 on cuda (fp32 arithmetic).  Results come back in the\n"      \
    "caller's framework; backend= picks cuda or cpu (see qkernels.explain).  Index values are checked\n"    \
    "on cpu; on cuda an out-of-range index is never followed outside the tensors (QKERNELS_CHECK=1\n"      \
    "validates sparse_aggregate's)."

#define QK_ATTN_DOC                                                                                        \
    "bfloat16/float16 on cuda (head_dim 32, 64, 128 or 256), also float32 on cpu; fp32 scores, softmax and\n" \
    "accumulation, one rounding; scale defaults to 1/sqrt(D); a sequence with no kept key gives 0.\n"         \
    "backend= picks cuda, flash (attn_decode and attn_prefill without mask) or cpu (see qkernels.explain).\n"  \
    "Index values are checked on cpu; on cuda lengths are clamped and out-of-range slots skipped."

#define QK_DENSE_DOC                                                                                       \
    "bfloat16/float16 on cuda, also float32 on cpu; all tensors but freqs_cis of one dtype.  Inner\n"      \
    "dimensions must be unit-stride; rows may be strided.  backend= picks cuda or cpu (see\n"            \
    "qkernels.explain)."

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
