// `lmloss check`: every operation of the library on each backend and dtype, against the float64
// reference (tests/reference), on one small random problem with every option on. The error of an
// operation is the largest ||out - ref|| / ||ref|| over its outputs; the bound is the input
// dtype's row of kTolerances (tolerances.hpp).
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "commands.hpp"
#include "common.hpp"
#include "lmloss/lmloss.hpp"
#include "reference.hpp"
#include "tolerances.hpp"

namespace lmloss::tools {
namespace {

namespace ref = lmloss::reference;

// The problem: odd sizes, a vocabulary split over several chunks at the check's budget.
constexpr int64_t kTokens = 67;
constexpr int64_t kVocab = 1001;
constexpr int64_t kHidden = 48;
constexpr int64_t kTopK = 8;
constexpr int64_t kLogitsPad = 3;  // logits rows are views into rows of kVocab + kLogitsPad
constexpr int64_t kIgnoreIndex = -100;
// Two chunks or more per call at every dtype (about 30 rows of kVocab f32 logits).
constexpr size_t kDefaultBudgetBytes = 128 * 1024;

// The random problem, every float already rounded to the dtype under test (so the reference
// sees exactly what the backend reads).
struct Data {
  int64_t n = kTokens, v = kVocab, h = kHidden, k = kTopK;
  std::vector<double> logits;         // (n, v)
  std::vector<double> hidden;         // (n, h)
  std::vector<double> weight;         // (v, h)
  std::vector<double> bias;           // (v)
  std::vector<int64_t> labels;        // (n), some ignore_index
  std::vector<int64_t> teacher_ids;   // (n, k)
  std::vector<double> teacher_probs;  // (n, k), rows sum to 1, one zero entry
  std::vector<uint8_t> token_mask;    // (n), one token off
  std::vector<double> upstream;       // (n), per-token upstream gradient for reduction none
};

Data make_data(uint64_t seed, lmloss_dtype dtype) {
  Rng rng(seed);
  Data d;
  auto rounded = [&](double x) { return round_to(dtype, x); };
  d.logits.resize(d.n * d.v);
  for (double& z : d.logits) z = rounded(rng.normal(4.0));
  // Outliers past the soft cap, so capping and a peaked softmax are both exercised.
  for (int64_t t = 0; t < d.n; t += 5)
    d.logits[t * d.v + rng.index(d.v)] = rounded(rng.uniform(35, 60));
  for (int64_t t = 2; t < d.n; t += 7)
    d.logits[t * d.v + rng.index(d.v)] = rounded(-rng.uniform(35, 60));
  // A three-way tie at the top of row 1: top-k must break it by the lower id.
  for (int64_t id : {400, 17, 5}) d.logits[1 * d.v + id] = rounded(70.0);

  d.hidden.resize(d.n * d.h);
  for (double& x : d.hidden) x = rounded(rng.normal(1.0));
  d.weight.resize(d.v * d.h);
  for (double& w : d.weight) w = rounded(rng.normal(4.0 / std::sqrt(double(d.h))));
  d.bias.resize(d.v);
  for (double& b : d.bias) b = rounded(rng.normal(0.5));

  d.labels.resize(d.n);
  for (int64_t& y : d.labels) y = rng.index(d.v);
  d.labels[3] = kIgnoreIndex;
  d.labels[10] = kIgnoreIndex;

  const lmloss_dtype probs_dtype = compute_dtype(dtype);
  d.teacher_ids.resize(d.n * d.k);
  d.teacher_probs.resize(d.n * d.k);
  for (int64_t t = 0; t < d.n; ++t) {
    const std::vector<int64_t> ids = rng.distinct(d.k, d.v);
    double mass = 0;
    std::vector<double> raw(d.k);
    for (int64_t i = 0; i < d.k; ++i) mass += raw[i] = rng.uniform(0.01, 1.0);
    if (t == 2) mass -= raw[d.k - 1], raw[d.k - 1] = 0;  // P = 0 contributes nothing
    for (int64_t i = 0; i < d.k; ++i) {
      d.teacher_ids[t * d.k + i] = ids[i];
      d.teacher_probs[t * d.k + i] = round_to(probs_dtype, raw[i] / mass);
    }
  }
  d.token_mask.assign(d.n, 1);
  d.token_mask[5] = 0;
  d.upstream.resize(d.n);
  for (double& g : d.upstream) g = round_to(probs_dtype, rng.uniform(-1.0, 2.0));
  return d;
}

// ---- tensors on the backend under test ---------------------------------------------------------

struct Shape {
  int32_t ndim;
  int64_t rows;
  int64_t cols;
  int64_t stride;  // elements between rows; 0: cols
};
Shape scalar_shape() { return {0, 1, 1, 0}; }
Shape vector_shape(int64_t n) { return {1, n, 1, 0}; }
Shape matrix_shape(int64_t rows, int64_t cols, int64_t stride = 0) {
  return {2, rows, cols, stride};
}

bool is_float(lmloss_dtype dtype) {
  return dtype == LMLOSS_F32 || dtype == LMLOSS_F64 || dtype == LMLOSS_BF16 || dtype == LMLOSS_F16;
}

// The buffers of one call. Inputs carry the values; outputs and the padding between rows start
// as NaN (ints: -1), so an element left unwritten, or padding read, shows in the error.
class Tensors {
 public:
  explicit Tensors(lmloss_device_type device) : device_(device) {}

  lmloss_tensor input(lmloss_dtype dtype, Shape shape, const std::vector<double>& values) {
    return make(dtype, shape, &values);
  }
  template <typename Int>
  lmloss_tensor input(lmloss_dtype dtype, Shape shape, const std::vector<Int>& values) {
    const std::vector<double> as_double(values.begin(), values.end());
    return make(dtype, shape, &as_double);
  }
  lmloss_tensor output(lmloss_dtype dtype, Shape shape) { return make(dtype, shape, nullptr); }

  // The tensor's values, row-major without the padding.
  std::vector<double> read(const lmloss_tensor& t) const {
    const auto& [buffer, shape] = buffers_.at(t.data);
    const int64_t stride = shape.stride ? shape.stride : shape.cols;
    const int64_t stored = (shape.rows - 1) * stride + shape.cols;
    std::vector<unsigned char> bytes(buffer->bytes());
    buffer->download(bytes.data(), bytes.size());
    std::vector<double> all(stored);
    decode(t.dtype, bytes.data(), stored, all.data());
    std::vector<double> values(shape.rows * shape.cols);
    for (int64_t r = 0; r < shape.rows; ++r) {
      for (int64_t c = 0; c < shape.cols; ++c) values[r * shape.cols + c] = all[r * stride + c];
    }
    return values;
  }

 private:
  lmloss_tensor make(lmloss_dtype dtype, Shape shape, const std::vector<double>* values) {
    const int64_t stride = shape.stride ? shape.stride : shape.cols;
    const int64_t stored = (shape.rows - 1) * stride + shape.cols;
    std::vector<double> host(stored, is_float(dtype) ? NAN : -1.0);
    if (values) {
      if (static_cast<int64_t>(values->size()) != shape.rows * shape.cols) {
        throw std::logic_error("check: input of the wrong size");
      }
      for (int64_t r = 0; r < shape.rows; ++r) {
        for (int64_t c = 0; c < shape.cols; ++c)
          host[r * stride + c] = (*values)[r * shape.cols + c];
      }
    }
    const size_t bytes = stored * dtype_size(dtype);
    std::vector<unsigned char> encoded(bytes);
    encode(dtype, host.data(), stored, encoded.data());
    auto buffer = std::make_unique<Buffer>(device_, bytes);
    buffer->upload(encoded.data(), bytes);

    lmloss_tensor t = lmloss_tensor_none();
    t.data = buffer->data();
    t.dtype = dtype;
    t.ndim = shape.ndim;
    if (shape.ndim >= 1) t.shape[0] = shape.rows;
    if (shape.ndim == 2) t.shape[1] = shape.cols;
    t.stride = shape.ndim == 2 ? shape.stride : 0;
    t.device_type = device_;
    t.device_index = 0;
    buffers_.emplace(t.data, std::make_pair(std::move(buffer), shape));
    return t;
  }

  lmloss_device_type device_;
  std::map<void*, std::pair<std::unique_ptr<Buffer>, Shape>> buffers_;
};

// ---- the operations --------------------------------------------------------------------------

struct Outcome {
  std::optional<double> forward_error;  // loss and lse; top-k: selected values, probs, tail
  std::optional<double> grad_error;     // every gradient
  std::string note;
};

double worst(std::optional<double> a, double b) {
  // NaN must win, so that a NaN error fails rather than vanishing in a max.
  if (!a) return b;
  if (std::isnan(*a) || std::isnan(b)) return NAN;
  return std::max(*a, b);
}

enum class Head { logits, linear };
enum class Call { forward, backward, fused };
enum class Upstream { none, scalar, per_token };

struct LossOp {
  const char* name;
  Head head;
  Call call;
  bool distill;   // teacher targets and a token mask beside the labels
  bool in_place;  // grad_logits written over the logits
  Upstream upstream;
  lmloss_loss_options options;
};

lmloss_loss_options ce_options(lmloss_reduction reduction = LMLOSS_REDUCTION_MEAN) {
  lmloss_loss_options o = lmloss_loss_options_default();
  o.reduction = reduction;
  o.ignore_index = kIgnoreIndex;
  o.label_smoothing = 0.1;
  o.z_loss = 1e-4;
  o.softcap = 30.0;
  o.temperature = 1.5;
  return o;
}

lmloss_loss_options distill_options() {
  lmloss_loss_options o = ce_options();
  o.ce_weight = 0.4;
  o.kd_weight = 0.6;
  o.label_smoothing = 0.0;
  o.temperature = 2.0;
  return o;
}

std::vector<LossOp> loss_ops() {
  lmloss_loss_options with_normalizer = ce_options();
  with_normalizer.normalizer = 100.0;  // a micro-batch of a 100-token step
  lmloss_loss_options summed = ce_options(LMLOSS_REDUCTION_SUM);
  return {
      {"ce logits fwd", Head::logits, Call::forward, false, false, Upstream::none, ce_options()},
      {"ce logits bwd (none)", Head::logits, Call::backward, false, false, Upstream::per_token,
       ce_options(LMLOSS_REDUCTION_NONE)},
      {"ce logits fused", Head::logits, Call::fused, false, false, Upstream::none, ce_options()},
      {"ce logits fused in-place", Head::logits, Call::fused, false, true, Upstream::scalar,
       summed},
      {"ce linear fwd", Head::linear, Call::forward, false, false, Upstream::none, ce_options()},
      {"ce linear bwd", Head::linear, Call::backward, false, false, Upstream::scalar, ce_options()},
      {"ce linear fused", Head::linear, Call::fused, false, false, Upstream::none, with_normalizer},
      {"distill+ce linear fwd", Head::linear, Call::forward, true, false, Upstream::none,
       distill_options()},
      {"distill+ce linear bwd", Head::linear, Call::backward, true, false, Upstream::none,
       distill_options()},
      {"distill+ce linear fused", Head::linear, Call::fused, true, false, Upstream::none,
       distill_options()},
  };
}

ref::Problem reference_problem(const Data& d, Head head, bool distill) {
  ref::Problem p;
  p.n_tokens = d.n;
  p.vocab = d.v;
  if (head == Head::logits) {
    p.logits = d.logits;
  } else {
    p.hidden = d.h;
    p.hidden_states = d.hidden;
    p.weight = d.weight;
    p.bias = d.bias;
  }
  p.labels = d.labels;
  if (distill) {
    p.top_k = d.k;
    p.teacher_ids = d.teacher_ids;
    p.teacher_probs = d.teacher_probs;
    p.token_mask = d.token_mask;
  }
  return p;
}

// Tensors the operation reads, on the backend under test.
lmloss_head make_head(Tensors& ts, const Data& d, Head head, lmloss_dtype dtype) {
  lmloss_head h{lmloss_tensor_none(), lmloss_tensor_none(), lmloss_tensor_none(),
                lmloss_tensor_none()};
  if (head == Head::logits) {
    h.logits = ts.input(dtype, matrix_shape(d.n, d.v, d.v + kLogitsPad), d.logits);
  } else {
    h.hidden = ts.input(dtype, matrix_shape(d.n, d.h), d.hidden);
    h.weight = ts.input(dtype, matrix_shape(d.v, d.h), d.weight);
    h.bias = ts.input(dtype, vector_shape(d.v), d.bias);
  }
  return h;
}

Outcome run_loss_op(lmloss_context* ctx, const LossOp& op, const Data& d, lmloss_dtype dtype,
                    lmloss_device_type device) {
  const lmloss_dtype cdt = compute_dtype(dtype);
  const lmloss_loss_options& o = op.options;
  const bool per_token = o.reduction == LMLOSS_REDUCTION_NONE;
  Tensors ts(device);

  const lmloss_head head = make_head(ts, d, op.head, dtype);
  lmloss_targets targets{lmloss_tensor_none(), lmloss_tensor_none(), lmloss_tensor_none(),
                         lmloss_tensor_none()};
  // Both label widths are exercised: i32 with logits, i64 through the head.
  targets.labels =
      ts.input(op.head == Head::logits ? LMLOSS_I32 : LMLOSS_I64, vector_shape(d.n), d.labels);
  if (op.distill) {
    targets.teacher_ids = ts.input(LMLOSS_I32, matrix_shape(d.n, d.k), d.teacher_ids);
    targets.teacher_probs = ts.input(cdt, matrix_shape(d.n, d.k), d.teacher_probs);
    targets.token_mask = ts.input(LMLOSS_U8, vector_shape(d.n), d.token_mask);
  }

  std::vector<double> upstream;
  if (op.upstream == Upstream::scalar) upstream = {0.75};
  if (op.upstream == Upstream::per_token) upstream = d.upstream;
  const ref::LossResult r = ref::loss(reference_problem(d, op.head, op.distill), o, upstream);

  lmloss_tensor loss = lmloss_tensor_none();
  lmloss_tensor lse = lmloss_tensor_none();
  lmloss_tensor grad_loss = lmloss_tensor_none();
  if (!upstream.empty()) {
    grad_loss = per_token ? ts.input(cdt, vector_shape(d.n), upstream)
                          : ts.input(cdt, scalar_shape(), upstream);
  }
  lmloss_grads grads{lmloss_tensor_none(), lmloss_tensor_none(), lmloss_tensor_none(),
                     lmloss_tensor_none()};
  if (op.call != Call::backward) {
    loss = per_token ? ts.output(cdt, vector_shape(d.n)) : ts.output(cdt, scalar_shape());
    lse = ts.output(cdt, vector_shape(d.n));
  } else {
    // The reference's lse, as a forward would have saved it: the backward alone is under test.
    std::vector<double> saved(r.lse);
    for (double& x : saved) x = round_to(cdt, x);
    lse = ts.input(cdt, vector_shape(d.n), saved);
  }
  if (op.call != Call::forward) {
    if (op.head == Head::logits) {
      grads.grad_logits = op.in_place ? head.logits : ts.output(dtype, matrix_shape(d.n, d.v));
    } else {
      // dW in f32 for half inputs, as a trainer keeps it.
      const lmloss_dtype weight_grad_dtype = dtype == LMLOSS_F64 ? LMLOSS_F64 : LMLOSS_F32;
      grads.grad_hidden = ts.output(dtype, matrix_shape(d.n, d.h));
      grads.grad_weight = ts.output(weight_grad_dtype, matrix_shape(d.v, d.h));
      grads.grad_bias = ts.output(dtype, vector_shape(d.v));
    }
  }

  lmloss_status status = LMLOSS_SUCCESS;
  switch (op.call) {
    case Call::forward:
      status = lmloss_loss_forward(ctx, &head, &targets, &o, &loss, &lse);
      break;
    case Call::backward:
      status = lmloss_loss_backward(ctx, &head, &targets, &o, &lse, &grad_loss, &grads);
      break;
    case Call::fused:
      status =
          lmloss_loss_forward_backward(ctx, &head, &targets, &o, &grad_loss, &loss, &lse, &grads);
      break;
  }
  lmloss::check(status);
  lmloss::check(lmloss_context_synchronize(ctx));

  Outcome out;
  if (op.call != Call::backward) {
    out.forward_error =
        worst(ref::relative_error(ts.read(loss), r.loss), ref::relative_error(ts.read(lse), r.lse));
  }
  if (op.call != Call::forward) {
    if (op.head == Head::logits) {
      out.grad_error = ref::relative_error(ts.read(grads.grad_logits), r.grad_logits);
    } else {
      double e = ref::relative_error(ts.read(grads.grad_hidden), r.grad_hidden);
      e = worst(e, ref::relative_error(ts.read(grads.grad_weight), r.grad_weight));
      e = worst(e, ref::relative_error(ts.read(grads.grad_bias), r.grad_bias));
      out.grad_error = e;
    }
  }
  return out;
}

struct TopkOp {
  const char* name;
  Head head;
  int32_t renormalize;
};

std::vector<TopkOp> topk_ops() {
  return {
      {"topk logits renorm", Head::logits, 1},
      {"topk logits full", Head::logits, 0},
      {"topk linear renorm", Head::linear, 1},
      {"topk linear full", Head::linear, 0},
  };
}

Outcome run_topk_op(lmloss_context* ctx, const TopkOp& op, const Data& d, lmloss_dtype dtype,
                    lmloss_device_type device) {
  const lmloss_dtype cdt = compute_dtype(dtype);
  lmloss_topk_options o = lmloss_topk_options_default();
  o.k = d.k;
  o.softcap = 30.0;
  o.temperature = 1.5;
  o.renormalize = op.renormalize;
  Tensors ts(device);
  const lmloss_head head = make_head(ts, d, op.head, dtype);
  const lmloss_tensor ids = ts.output(LMLOSS_I32, matrix_shape(d.n, d.k));
  const lmloss_tensor probs = ts.output(cdt, matrix_shape(d.n, d.k));
  const lmloss_tensor tail = ts.output(cdt, vector_shape(d.n));
  lmloss::check(lmloss_topk(ctx, &head, &o, &ids, &probs, &tail));
  lmloss::check(lmloss_context_synchronize(ctx));

  const ref::Problem problem = reference_problem(d, op.head, false);
  const ref::TopkResult r = ref::topk(problem, o);
  const std::vector<double> z = ref::logits(problem);  // (n, v)
  const std::vector<double> got_ids = ts.read(ids);

  // Ids are compared through the reference logits they select: a near-tie resolved the other
  // way by rounding costs (almost) nothing, a wrong id costs its whole gap. The logits are a
  // monotone function of the scaled logits, so the order is the same. An exact tie in the
  // reference has one right answer (the lower id first), so an id differing there is an error.
  std::vector<double> selected(d.n * d.k), expected(d.n * d.k);
  int64_t near_ties = 0, broken_ties = 0;
  bool out_of_range = false;
  for (int64_t t = 0; t < d.n; ++t) {
    for (int64_t i = 0; i < d.k; ++i) {
      const double id = got_ids[t * d.k + i];
      const int64_t want = r.ids[t * d.k + i];
      expected[t * d.k + i] = z[t * d.v + want];
      if (!(id >= 0 && id < d.v)) {
        out_of_range = true;
        continue;
      }
      const int64_t got = static_cast<int64_t>(id);
      selected[t * d.k + i] = z[t * d.v + got];
      if (got == want) continue;
      if (z[t * d.v + got] == z[t * d.v + want])
        ++broken_ties;
      else
        ++near_ties;
    }
  }
  Outcome out;
  double e = out_of_range || broken_ties ? INFINITY : ref::relative_error(selected, expected);
  e = worst(e, ref::relative_error(ts.read(probs), r.probs));
  e = worst(e, ref::relative_error(ts.read(tail), r.tail));
  out.forward_error = e;
  if (out_of_range) out.note = "ids out of range";
  if (broken_ties)
    out.note = std::to_string(broken_ties) + " exact ties not broken by the lower id";
  if (near_ties)
    out.note += (out.note.empty() ? "" : "; ") + std::to_string(near_ties) +
                " ids differ from the reference (near-ties if the error is small)";
  return out;
}

// ---- the table ------------------------------------------------------------------------------

std::string format_error(std::optional<double> e) {
  if (!e) return "-";
  char text[32];
  std::snprintf(text, sizeof(text), "%.2e", *e);
  return text;
}

struct Row {
  std::string backend, op, dtype;
  std::optional<double> forward_error, grad_error;
  double tolerance;
  bool passed;
  std::string note;
};

void print_header() {
  std::printf("%-7s %-26s %-5s %-10s %-10s %-8s %-6s %s\n", "backend", "op", "dtype", "loss/out",
              "grads", "tol", "result", "note");
}

void print_row(const Row& r) {
  std::printf("%-7s %-26s %-5s %-10s %-10s %-8.0e %-6s %s\n", r.backend.c_str(), r.op.c_str(),
              r.dtype.c_str(), format_error(r.forward_error).c_str(),
              format_error(r.grad_error).c_str(), r.tolerance, r.passed ? "PASS" : "FAIL",
              r.note.c_str());
  std::fflush(stdout);
}

// Runs one op and turns its outcome, or the error it raised, into a row.
template <typename Op, typename RunFn>
Row run_row(const char* backend, const Op& op, lmloss_dtype dtype, RunFn&& run) {
  Row row{backend, op.name, dtype_name(dtype), std::nullopt, std::nullopt, tolerance_for(dtype),
          false,   ""};
  try {
    const Outcome out = run();
    row.forward_error = out.forward_error;
    row.grad_error = out.grad_error;
    row.note = out.note;
    const auto within = [&](std::optional<double> e) { return !e || *e <= row.tolerance; };
    row.passed = within(out.forward_error) && within(out.grad_error);
  } catch (const lmloss::Error& e) {
    row.note = std::string(lmloss_status_string(e.status())) + ": " + e.what();
  } catch (const std::exception& e) {
    row.note = e.what();
  }
  return row;
}

}  // namespace

std::string check_tolerances_text() {
  std::string text;
  for (const Tolerance& t : kTolerances) {
    char entry[32];
    std::snprintf(entry, sizeof(entry), "%s%s %.0e", text.empty() ? "" : ", ", dtype_name(t.dtype),
                  t.relative);
    text += entry;
  }
  return text;
}

int run_check(const CheckOptions& options) {
  struct Target {
    const char* name;
    lmloss_device_type device;
    std::vector<lmloss_dtype> dtypes;
  };
  std::vector<Target> targets;
  bool skipped_requested = false;
  if (options.backend == "cpu" || options.backend == "all") {
    targets.push_back(
        {"cpu", LMLOSS_DEVICE_CPU, {LMLOSS_F64, LMLOSS_F32, LMLOSS_BF16, LMLOSS_F16}});
  }
  if (options.backend == "cuda" || options.backend == "all") {
    const std::string reason = cuda_unavailable_reason();
    if (reason.empty()) {
      targets.push_back({"cuda", LMLOSS_DEVICE_CUDA, {LMLOSS_F32, LMLOSS_BF16, LMLOSS_F16}});
    } else {
      std::printf("cuda: not available (%s)\n", reason.c_str());
      skipped_requested = options.backend == "cuda";
    }
  }
  if (!options.dtypes.empty()) {
    for (Target& t : targets) {
      std::vector<lmloss_dtype> chosen;
      for (lmloss_dtype d : t.dtypes) {
        for (const std::string& name : options.dtypes) {
          if (name == dtype_name(d)) chosen.push_back(d);
        }
      }
      t.dtypes = chosen;
    }
  }

  int failed = 0, ran = 0;
  print_header();
  for (const Target& target : targets) {
    lmloss::Context ctx;
    ctx.set_workspace_budget(options.budget_bytes ? options.budget_bytes : kDefaultBudgetBytes);
    for (lmloss_dtype dtype : target.dtypes) {
      const Data data = make_data(options.seed, dtype);
      for (const LossOp& op : loss_ops()) {
        const Row row = run_row(target.name, op, dtype, [&] {
          return run_loss_op(ctx.get(), op, data, dtype, target.device);
        });
        print_row(row);
        ++ran;
        failed += !row.passed;
      }
      for (const TopkOp& op : topk_ops()) {
        const Row row = run_row(target.name, op, dtype, [&] {
          return run_topk_op(ctx.get(), op, data, dtype, target.device);
        });
        print_row(row);
        ++ran;
        failed += !row.passed;
      }
    }
  }
  std::printf("%d of %d passed\n", ran - failed, ran);
  // Nothing run on a backend asked for by name is not a pass.
  return failed == 0 && ran > 0 && !skipped_requested ? 0 : 1;
}

}  // namespace lmloss::tools
