/* Argument checks the attention bindings share (attn_decode.c, attn_prefill.c).  Each returns -1
 * with the exception set, naming the op and the argument. */
#ifndef QK_ATTN_COMMON_H
#define QK_ATTN_COMMON_H

#include "../qk.h"

#define QK_GIVEN(obj) ((obj) != NULL && (obj) != Py_None)

/* Import the tensor arguments a[0..n) that were given (None and absent stay zeroed views); *n_in
 * counts the views to release; all on one device. */
int qk_attn_import(qk_state *st, const char *op, PyObject **a, const char *const *names, int nrequired, int n,
                   void *stream,
                   qk_view *in, int *n_in);
/* The attention ops' out, after their argument checks: the launch begun on the device of in[0] = q
 * (*launched set), out of q's dtype and shape (ndim, shape) from out_obj or fresh, not overlapping the n
 * inputs unless it is q itself, with unit-stride rows (and 16-byte rows on cuda where rows16). */
int qk_attn_output(qk_state *st, const char *op, PyObject *out_obj, const qk_view *in, const char *const *names, int n,
                   void *stream, int stream_given, int ndim, const int64_t *shape, int rows16, qk_launch *l,
                   int *launched, qk_view *ov, qk_output *o);
/* The last dim is unit-stride (an empty tensor's strides are arbitrary). */
int qk_attn_check_unit(const char *op, const char *arg, const qk_view *v);
/* cuda: 16-byte aligned data pointer and outer strides (rows read as 16-byte vectors). */
int qk_attn_check_rows16(const char *op, const char *arg, const qk_view *v);
/* A size-1 dimension's stride is never used; 0 keeps the kernel's alignment test off it. */
static inline int64_t qk_attn_stride(const qk_view *v, int dim) { return v->shape[dim] > 1 ? v->strides[dim] : 0; }
/* D >= 1, Hq a multiple of Hkv >= 1, and a head_dim cuda was built for. */
int qk_attn_check_heads(const char *op, const char *q, const char *k, int64_t Hq, int64_t Hkv, int64_t D, int cuda);
/* scale: a finite float, or None for 1/sqrt(D). */
int qk_attn_scale(const char *op, PyObject *obj, int64_t D, float *scale);
/* The dense ops' k and v [B, Lkv, Hkv, D] of q's dtype, for q [B, ., Hq, D] already checked for rank
 * and dtype; then the heads (qk_attn_check_heads), unit-stride rows and, on cuda, 16-byte rows of q,
 * k and v. */
int qk_attn_check_dense_kv(const char *op, const qk_view *q, const qk_view *k, const qk_view *v);
/* The paged ops' token pool p[0..4] = k_cache, v_cache [S, Hkv, D] of q's dtype, req_to_token
 * [R, max_ctx], req_pool_indices [B] and kv_indptr [B + 1] (int32 or int64), for q [., Hq, D]
 * already checked for rank and dtype; then heads, unit-stride and 16-byte rows as above. */
int qk_attn_check_pool(const char *op, const qk_view *q, const qk_view *p, int64_t B);
/* The mask's kind by dtype, as scaled_dot_product_attention takes it: 0 bool (True = keep), 1 additive
 * float, float32 or q's dtype when that is float16 / bfloat16 (*dtype set); -1 (TypeError) otherwise. */
int qk_attn_mask_dtype(const char *op, const qk_view *m, const qk_view *q, int *dtype);
/* A key mask [B, L] (dtype checked by the caller); flags QK_ATTN_MASK_3D (decode) also take [B|1, L],
 * [B|1, 1, L] and [B|1, 1, 1, L], broadcast over B when its size is 1 (SDPA's decode masks), and
 * QK_ATTN_MASK_NARROW (paged) a last dim W <= L (at least 1 unless L is 0): positions from W on are
 * masked out.  L_name names L in the message. */
enum { QK_ATTN_MASK_3D = 1, QK_ATTN_MASK_NARROW = 2 };
int qk_attn_check_mask(const char *op, const qk_view *m, int64_t B, int64_t L, const char *L_name, int flags);
/* The mask's data: a non-NULL pointer even for an empty mask (NULL means no mask; it is never read). */
const void *qk_attn_mask_data(const qk_view *m);
/* ValueError for a token-pool index the CPU launcher rejected: bad_arg 0 req_pool_indices, 1 a
 * kv_indptr length, 2 a req_to_token slot (bad_pos = row * max_ctx + position). */
void qk_attn_raise_pool_index(const char *op, int bad_arg, int64_t bad_pos, int64_t bad_value, int64_t num_requests,
                              int64_t max_ctx, int64_t pool_size);

#endif
