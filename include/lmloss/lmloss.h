/*
 * lmloss — losses at the head of a language model, without the full logits.
 *
 * The C ABI. It compiles as C99 and as C++; every call returns an lmloss_status, and on failure
 * lmloss_last_error() holds a message naming the offending argument. No call aborts the process,
 * and a call that fails validation writes none of its outputs.
 *
 * The math (docs/contract.md has it in full):
 *   s = z = X W^T + b          (or the caller's logits z)
 *   s = c tanh(s / c)          (soft-capping, c > 0)
 *   s = s / T                  (temperature, T > 0)
 *   lse_t = log sum_j exp(s_tj),  p = exp(s - lse)
 *   ce_t  = lse_t - (1 - eps) s_t,y - (eps / V) sum_j s_tj
 *   zl_t  = lambda lse_t^2
 *   kd_t  = sum_k P_tk (log P_tk - (s_t,I_tk - lse_t))
 *   l_t   = alpha ce_t + zl_t + beta kd_t, over counted tokens; reduced by mean, sum or none.
 *
 * Tensors are described, not owned: lmloss_tensor points at the caller's memory (CPU or CUDA).
 * The last dimension is contiguous; `stride` is the stride of the first dimension in elements, so
 * rows may be views into larger buffers. An output may not share a byte with an input or with
 * another output, except where a call says it may be written in place.
 */
#ifndef LMLOSS_LMLOSS_H
#define LMLOSS_LMLOSS_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define LMLOSS_API __declspec(dllexport)
#else
#define LMLOSS_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define LMLOSS_VERSION_MAJOR 0
#define LMLOSS_VERSION_MINOR 3
#define LMLOSS_VERSION_PATCH 0

/* ---- Status -------------------------------------------------------------------------------- */

typedef enum lmloss_status {
  LMLOSS_SUCCESS = 0,
  LMLOSS_ERROR_INVALID_ARGUMENT = 1, /* shape, dtype, stride, device, value or outputs overlapping
                                        inputs or each other: nothing written */
  LMLOSS_ERROR_UNSUPPORTED = 2,      /* valid, but not in this build or on this backend */
  LMLOSS_ERROR_OUT_OF_MEMORY = 3,    /* workspace could not be allocated: nothing written */
  LMLOSS_ERROR_ID_OUT_OF_RANGE = 4,  /* a label or teacher id found out of range on the device (on
                                        the CPU the call returns INVALID_ARGUMENT instead) */
  LMLOSS_ERROR_BACKEND = 5,          /* the BLAS, CUDA or cuBLASLt call failed */
  LMLOSS_ERROR_INTERNAL = 6,
  LMLOSS_STATUS_COUNT
} lmloss_status;

/* A constant string for a status; never NULL. */
LMLOSS_API const char* lmloss_status_string(lmloss_status status);
/* The message of this thread's last failed call ("" after a success). Valid until the next call. */
LMLOSS_API const char* lmloss_last_error(void);
/* The library's version as MAJOR * 10000 + MINOR * 100 + PATCH. */
LMLOSS_API int lmloss_version(void);

/* ---- Tensors ------------------------------------------------------------------------------- */

typedef enum lmloss_dtype {
  LMLOSS_F32 = 0,
  LMLOSS_F16 = 1,
  LMLOSS_BF16 = 2,
  LMLOSS_F64 = 3, /* CPU only: arithmetic in double, for exact checks */
  LMLOSS_I32 = 4,
  LMLOSS_I64 = 5,
  LMLOSS_U8 = 6,  /* token masks: nonzero = counted */
  LMLOSS_DTYPE_COUNT
} lmloss_dtype;

typedef enum lmloss_device_type {
  LMLOSS_DEVICE_CPU = 0,
  LMLOSS_DEVICE_CUDA = 1,
  LMLOSS_DEVICE_TYPE_COUNT
} lmloss_device_type;

typedef struct lmloss_tensor {
  void* data;                     /* NULL: the argument is absent (an empty one: any non-NULL) */
  lmloss_dtype dtype;
  int32_t ndim;                   /* 0, 1 or 2 */
  int64_t shape[2];
  int64_t stride;                 /* first dimension's stride in elements; 0: contiguous */
  lmloss_device_type device_type;
  int32_t device_index;           /* CUDA ordinal; 0 on the CPU */
} lmloss_tensor;

/* Describers for the common cases (CPU memory, contiguous unless a stride is given). */
static inline lmloss_tensor lmloss_tensor_none(void) {
  lmloss_tensor t = {NULL, LMLOSS_F32, 0, {0, 0}, 0, LMLOSS_DEVICE_CPU, 0};
  return t;
}
static inline lmloss_tensor lmloss_tensor_scalar(void* data, lmloss_dtype dtype) {
  lmloss_tensor t = {data, dtype, 0, {0, 0}, 0, LMLOSS_DEVICE_CPU, 0};
  return t;
}
static inline lmloss_tensor lmloss_tensor_1d(void* data, lmloss_dtype dtype, int64_t n) {
  lmloss_tensor t = {data, dtype, 1, {n, 0}, 0, LMLOSS_DEVICE_CPU, 0};
  return t;
}
static inline lmloss_tensor lmloss_tensor_2d(void* data, lmloss_dtype dtype, int64_t rows,
                                             int64_t cols, int64_t row_stride) {
  lmloss_tensor t = {data, dtype, 2, {rows, cols}, row_stride, LMLOSS_DEVICE_CPU, 0};
  return t;
}

/* ---- Context ------------------------------------------------------------------------------- */

/* Holds the CUDA stream, the workspace budget and allocator, the CPU thread count, cached plans
 * and the device-side error flag. One context per thread (or external locking). */
typedef struct lmloss_context lmloss_context;

/* Workspace allocator for CUDA memory (e.g. PyTorch's caching allocator). alloc returns NULL on
 * failure; both are called on the context's stream. */
typedef struct lmloss_allocator {
  void* (*alloc)(void* user, size_t bytes, int32_t device_index, void* stream);
  void (*free)(void* user, void* ptr, size_t bytes, int32_t device_index, void* stream);
  void* user;
} lmloss_allocator;

#define LMLOSS_DEFAULT_WORKSPACE_BYTES ((size_t)1 << 30) /* 1 GiB */

LMLOSS_API lmloss_status lmloss_context_create(lmloss_context** context);
LMLOSS_API lmloss_status lmloss_context_destroy(lmloss_context* context); /* NULL is fine */

/* The bound on the library's own working memory (logits chunks and scratch), in bytes. Calls plan
 * their chunks to fit it; a problem whose smallest chunk (one row) does not fit fails with
 * LMLOSS_ERROR_INVALID_ARGUMENT. Default LMLOSS_DEFAULT_WORKSPACE_BYTES. */
LMLOSS_API lmloss_status lmloss_context_set_workspace_budget(lmloss_context* context, size_t bytes);
LMLOSS_API lmloss_status lmloss_context_get_workspace_budget(const lmloss_context* context,
                                                             size_t* bytes);
/* The most workspace bytes held at once since creation or the last reset. */
LMLOSS_API lmloss_status lmloss_context_get_peak_workspace(const lmloss_context* context,
                                                           size_t* bytes);
LMLOSS_API lmloss_status lmloss_context_reset_peak_workspace(lmloss_context* context);
/* CPU threads for the row kernels and the BLAS; 0 = all cores for the row kernels and the BLAS's
 * own count (default). OpenBLAS's count is the process's: a call of a context with a count sets it
 * for the call and puts the previous one back, so contexts of different counts used at once from
 * several threads may run their products with either count (the same values to rounding). */
LMLOSS_API lmloss_status lmloss_context_set_num_threads(lmloss_context* context, int num_threads);

/* CUDA: the stream (a cudaStream_t; NULL = the legacy default stream) on which calls enqueue work.
 * Calls never synchronise it. A call may run part of its work on a second stream of the context's
 * own, forked from this one by an event and joined back into it before the call returns: work the
 * caller enqueues after a call waits for all of it. Calls after the context's first CUDA call (which
 * makes its handles, and is refused under capture) can be captured into a CUDA graph. */
LMLOSS_API lmloss_status lmloss_context_set_stream(lmloss_context* context, void* stream);
/* CUDA: when enabled (off by default), the first call that meets a product shape times every
 * algorithm cuBLASLt's heuristic offers for it, on that call's operands, and the context keeps
 * the fastest for later calls. That first call waits for the device (it synchronises the stream)
 * and does the work up to ~30 times over; later calls are as before. Results stay bitwise the
 * same from call to call on one context, but another context (or process) may time differently,
 * choose another algorithm and round differently. No effect on the CPU. */
LMLOSS_API lmloss_status lmloss_context_set_product_tuning(lmloss_context* context, int enabled);
/* CUDA: take workspace from this allocator instead of cudaMallocAsync. NULL restores the default. */
LMLOSS_API lmloss_status lmloss_context_set_allocator(lmloss_context* context,
                                                      const lmloss_allocator* allocator);
/* Waits for the context's stream and reports what the device found since the last check:
 * LMLOSS_ERROR_ID_OUT_OF_RANGE when a label or teacher id was out of range (that token's loss
 * is NaN and its gradient zero), then clears the flag. On the CPU such ids are caught before any
 * output is written, so this returns LMLOSS_SUCCESS. */
LMLOSS_API lmloss_status lmloss_context_synchronize(lmloss_context* context);

/* Whether a backend is compiled in and has a usable device (1) or not (0). */
LMLOSS_API int lmloss_backend_available(lmloss_device_type device_type);

/* ---- Losses -------------------------------------------------------------------------------- */

typedef enum lmloss_reduction {
  LMLOSS_REDUCTION_MEAN = 0, /* sum of l_t / D, D = counted tokens or the normalizer */
  LMLOSS_REDUCTION_SUM = 1,
  LMLOSS_REDUCTION_NONE = 2, /* the per-token vector l */
  LMLOSS_REDUCTION_COUNT
} lmloss_reduction;

/* Option flags. */
#define LMLOSS_ACCUMULATE_GRAD_WEIGHT 1u /* add into grad_weight instead of overwriting it */
#define LMLOSS_ACCUMULATE_GRAD_BIAS 2u   /* add into grad_bias instead of overwriting it */
/* A bf16/f16 grad_weight summed in f32 over the token chunks and rounded once, instead of rounded
 * after each chunk (whose error grows with the chunks: 2.4e-3 from float64 over 3, 4.9e-3 over 10,
 * against 1.7e-3 rounded once; docs/contract.md). CUDA: half of the f32 sum is held in
 * grad_weight's own bytes (when its rows are dense), the rest in (vocab - vocab / 2) x hidden x 4
 * bytes of workspace taken for the call beyond the budget (on sm_90, with a bf16 grad_weight,
 * vocab / 32 rows of bf16 more, for the last chunk's product to store over the sum). The CPU
 * always sums so, that rest within the budget. */
#define LMLOSS_SUM_GRAD_WEIGHT_IN_F32 4u

/* A 16-bit grad_weight's f32 sum can also be kept unrounded across calls that add to it (micro-
 * batches, with LMLOSS_ACCUMULATE_GRAD_WEIGHT after the first) and rounded once by
 * lmloss_round_grad_weight, with the upstream gradient as its scale: give the call
 * options.grad_weight_sum_tail, an f32 (tail_rows, hidden) tensor of the caller's. The sum's rows
 * [0, split), split = vocab - tail_rows, are then held in grad_weight's own bytes (row r at byte
 * offset 4 r hidden; split <= vocab / 2 and a multiple of 8, and, when split > 0, grad_weight's rows
 * dense and 16-byte aligned), the rest in the tail. The whole sum costs 4 bytes a weight, half of
 * them the gradient's own, where an f32 copy beside a 16-bit gradient costs 6. A tail that
 * starts where those rows end (split = vocab / 2: vocab a multiple of 16) makes the sum one f32
 * matrix, which each token chunk's product fills at once; else, on CUDA, each chunk takes one
 * product batched over both parts where the tail lies above those rows and split = vocab / 2, and
 * two products where not. This macro
 * gives the smallest tail; with tail_rows = vocab, grad_weight's bytes are unused until rounding.
 *
 * A bf16 grad_weight's sum can instead be kept in 3 bytes a weight: its bf16 values in
 * grad_weight itself and an 8-bit rest of each in a u8 (vocab, hidden) tail, the library's own
 * encoding (any row strides). The pair holds ~16 significant bits, within ~1e-5 of the f32 sum
 * over a few chunks or micro-batches, and rounds as it does but for values on a rounding
 * boundary; grad_weight reads as the sum rounded to bf16 even before lmloss_round_grad_weight.
 * On sm_90a each token chunk's product reads and writes the pair in one kernel (bf16 inputs, vocab
 * a multiple of 8, hidden of 16); elsewhere it goes through an f32 slice of the workspace. */
#define LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(vocab) ((vocab) - (vocab) / 16 * 8)

typedef struct lmloss_loss_options {
  uint32_t struct_size;        /* sizeof(lmloss_loss_options), set by the initializer */
  lmloss_reduction reduction;
  int64_t ignore_index;        /* a label equal to it is not counted; default -100 */
  double normalizer;           /* mean: divide by this instead of the counted tokens when > 0 */
  double ce_weight;            /* alpha, weight of cross-entropy; default 1 */
  double kd_weight;            /* beta, weight of top-k distillation; default 0 */
  double label_smoothing;      /* eps in [0, 1] */
  double z_loss;               /* lambda >= 0 */
  double softcap;              /* c > 0 caps the logits; 0: off */
  double temperature;          /* T > 0; default 1 */
  uint32_t flags;              /* LMLOSS_ACCUMULATE_* */
  /* Since 0.2 (a caller built against 0.1 passes the smaller struct_size and gets none). An
   * output, here as lmloss_grads has no size field to grow by: the f32 tail of a 16-bit
   * grad_weight's kept sum (see LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS); absent (data NULL) by default.
   * Read when grads.grad_weight is written; a backward or fused call given one without
   * grads.grad_weight is refused, a forward ignores it. */
  lmloss_tensor grad_weight_sum_tail;
  /* Since 0.3, an output as well: a fused step's last token chunk's dW product, left to
   * lmloss_round_grad_weight_deferred instead of added into a kept sum (see
   * lmloss_loss_deferred_bytes). A u8 vector of exactly that many bytes, its data 256-byte
   * aligned, on the inputs' device; absent (data NULL) by default. */
  lmloss_tensor grad_weight_deferred;
} lmloss_loss_options;

#define LMLOSS_LOSS_OPTIONS_INIT                                                              \
  { (uint32_t)sizeof(lmloss_loss_options), LMLOSS_REDUCTION_MEAN, -100, 0.0, 1.0, 0.0, 0.0, \
    0.0, 0.0, 1.0, 0u, {NULL, LMLOSS_F32, 0, {0, 0}, 0, LMLOSS_DEVICE_CPU, 0},               \
    {NULL, LMLOSS_U8, 0, {0, 0}, 0, LMLOSS_DEVICE_CPU, 0} }

static inline lmloss_loss_options lmloss_loss_options_default(void) {
  lmloss_loss_options o = LMLOSS_LOSS_OPTIONS_INIT;
  return o;
}

/* Where the logits come from: the caller's `logits`, or `hidden` and `weight` (and `bias`), in
 * which case the library forms them a chunk at a time and never holds all of them. */
typedef struct lmloss_head {
  lmloss_tensor logits; /* (n_tokens, vocab) */
  lmloss_tensor hidden; /* (n_tokens, hidden) */
  lmloss_tensor weight; /* (vocab, hidden), nn.Linear layout */
  lmloss_tensor bias;   /* (vocab), optional */
} lmloss_head;

/* What each token is scored against. Labels are needed when ce_weight != 0, the teacher's top-k
 * when kd_weight != 0. A token counts unless its label is ignore_index or its mask is 0 (with
 * neither given, every token counts). */
typedef struct lmloss_targets {
  lmloss_tensor labels;        /* (n_tokens) i32 or i64, in [0, vocab) or ignore_index */
  lmloss_tensor teacher_ids;   /* (n_tokens, top_k) i32 or i64, in [0, vocab) */
  lmloss_tensor teacher_probs; /* (n_tokens, top_k) f32 (f64 with f64 inputs) */
  lmloss_tensor token_mask;    /* (n_tokens) u8, optional: 0 = not counted */
} lmloss_targets;

/* Gradients wanted: leave a tensor absent (data NULL) to skip it. Float tensors of the input's
 * dtype or f32 (f64 for f64 inputs); grad_logits has the logits' dtype and may be the logits
 * themselves (same data and stride: the gradient is then written in place). */
typedef struct lmloss_grads {
  lmloss_tensor grad_logits; /* (n_tokens, vocab), logits inputs only */
  lmloss_tensor grad_hidden; /* (n_tokens, hidden) */
  lmloss_tensor grad_weight; /* (vocab, hidden); f32 recommended when accumulating */
  lmloss_tensor grad_bias;   /* (vocab) */
} lmloss_grads;

/* Forward. `loss` is a scalar (mean, sum) or (n_tokens) (none) of the compute dtype: f32, or f64
 * for f64 inputs; it is written on the inputs' device and not synchronised. `lse` (n_tokens),
 * optional, saves log-sum-exp of the scaled logits for lmloss_loss_backward. */
LMLOSS_API lmloss_status lmloss_loss_forward(lmloss_context* context, const lmloss_head* head,
                                             const lmloss_targets* targets,
                                             const lmloss_loss_options* options,
                                             const lmloss_tensor* loss, const lmloss_tensor* lse);

/* Backward from a saved `lse`: recomputes the logits a chunk at a time. `grad_loss` is the
 * upstream gradient: a scalar (mean, sum) or (n_tokens) (none), of the compute dtype; NULL or
 * absent means 1. */
LMLOSS_API lmloss_status lmloss_loss_backward(lmloss_context* context, const lmloss_head* head,
                                              const lmloss_targets* targets,
                                              const lmloss_loss_options* options,
                                              const lmloss_tensor* lse,
                                              const lmloss_tensor* grad_loss,
                                              const lmloss_grads* grads);

/* Forward and backward in one pass over the logits (what training uses): each chunk's logits are
 * formed once and their gradient taken before the next chunk. `lse` is optional. */
LMLOSS_API lmloss_status lmloss_loss_forward_backward(
    lmloss_context* context, const lmloss_head* head, const lmloss_targets* targets,
    const lmloss_loss_options* options, const lmloss_tensor* grad_loss, const lmloss_tensor* loss,
    const lmloss_tensor* lse, const lmloss_grads* grads);

/* A fused step with a kept sum (options.grad_weight_sum_tail, bf16) can leave its last token
 * chunk's dW product to the rounding, which then stores it straight into grad_weight as it reads
 * the sum (lmloss_round_grad_weight_deferred): no product into the sum and no rounding pass after
 * it. *bytes is what options.grad_weight_deferred must hold for lmloss_loss_forward_backward with
 * these same arguments (the options' grad_weight_deferred itself is not read), or 0 where nothing
 * is deferred: on the CPU, without a kept sum, for one token chunk, and where the store does not
 * run (CUDA before sm_90, a vocab or hidden not a multiple of 8; for a sum kept with rests, a
 * hidden not a multiple of 16). The step takes the buffer as its
 * logits workspace for every chunk, that much less of its own: its peak grows only by the chunk's
 * rows of X (2 bytes x rows x hidden), but the buffer lives until the rounding. Until then the
 * kept sum lacks that product: round it with lmloss_round_grad_weight_deferred before any other
 * call adds to it. */
LMLOSS_API lmloss_status lmloss_loss_deferred_bytes(
    lmloss_context* context, const lmloss_head* head, const lmloss_targets* targets,
    const lmloss_loss_options* options, const lmloss_tensor* grad_loss, const lmloss_tensor* loss,
    const lmloss_tensor* lse, const lmloss_grads* grads, size_t* bytes);

/* ---- Teacher top-k ------------------------------------------------------------------------- */

typedef struct lmloss_topk_options {
  uint32_t struct_size; /* sizeof(lmloss_topk_options), set by the initializer */
  int64_t k;            /* 1 <= k <= vocab */
  double softcap;       /* as in lmloss_loss_options */
  double temperature;
  int32_t renormalize;  /* 1: probs = softmax over the k selected; 0: full-vocabulary p, tail set */
} lmloss_topk_options;

#define LMLOSS_TOPK_OPTIONS_INIT { (uint32_t)sizeof(lmloss_topk_options), 1, 0.0, 1.0, 1 }

static inline lmloss_topk_options lmloss_topk_options_default(void) {
  lmloss_topk_options o = LMLOSS_TOPK_OPTIONS_INIT;
  return o;
}

/* The k largest scaled logits of each row: ids (n_tokens, k) i32 sorted by descending value, ties
 * to the lower id; probs (n_tokens, k) of the compute dtype; tail (n_tokens), optional, the mass
 * outside the k (1 - sum of probs when not renormalised, 0 when renormalised). */
LMLOSS_API lmloss_status lmloss_topk(lmloss_context* context, const lmloss_head* head,
                                     const lmloss_topk_options* options, const lmloss_tensor* ids,
                                     const lmloss_tensor* probs, const lmloss_tensor* tail);

/* ---- Gradient scaling ------------------------------------------------------------------------ */

/* out = grad * scale, computed in f32 (f64 for an f64 grad) and rounded once into out's dtype: for
 * a framework whose fused step formed the gradients for an upstream gradient of 1 (a 16-bit head's
 * dW kept in f32, dX in the head's dtype), once the real upstream gradient is known. grad: any
 * float dtype (f64 on the CPU only), rank 0-2, a vector contiguous; out: the same shape, any
 * float dtype, not overlapping grad unless it is grad itself; scale: one element of the product's
 * dtype (f32, or f64 for an f64 grad) on grad's device, or NULL for 1. On the context's stream;
 * nothing waits. */
LMLOSS_API lmloss_status lmloss_scale_gradient(lmloss_context* context, const lmloss_tensor* grad,
                                               const lmloss_tensor* scale, const lmloss_tensor* out);

/* grad_weight = round(sum * scale): the f32 sum a call kept in grad_weight's own bytes and in
 * `tail` (options.grad_weight_sum_tail), or the bf16 values and a u8 tail of their rests, rounded
 * once into grad_weight's bf16/f16, in place; the tail is only read. grad_weight and tail as the call that kept the sum had them; scale: one f32
 * element on their device, or NULL for 1. Afterwards grad_weight holds the gradient and no sum:
 * a later call starts a new one (without LMLOSS_ACCUMULATE_GRAD_WEIGHT). On the context's stream;
 * nothing waits. */
LMLOSS_API lmloss_status lmloss_round_grad_weight(lmloss_context* context,
                                                  const lmloss_tensor* grad_weight,
                                                  const lmloss_tensor* tail,
                                                  const lmloss_tensor* scale);

/* lmloss_round_grad_weight of a sum whose step left its last chunk's product in `deferred`
 * (that step's options.grad_weight_deferred): grad_weight = round(scale * (sum + the product)),
 * stored by the product itself, each value rounded once. `deferred` is only read; afterwards it may
 * be freed. */
LMLOSS_API lmloss_status lmloss_round_grad_weight_deferred(lmloss_context* context,
                                                           const lmloss_tensor* grad_weight,
                                                           const lmloss_tensor* tail,
                                                           const lmloss_tensor* scale,
                                                           const lmloss_tensor* deferred);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* LMLOSS_LMLOSS_H */
