// The float64 reference, written as the contract reads (docs/contract.md, sections 2 to 5):
// the full logits of every token, one token at a time, double everywhere. Deliberately naive.
#include "reference.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

namespace lmloss::reference {
namespace {

void check_id(int64_t id, int64_t vocab, const char* what) {
  if (id < 0 || id >= vocab) {
    throw std::out_of_range(std::string(what) + ": id " + std::to_string(id) +
                            " outside [0, " + std::to_string(vocab) + ")");
  }
}

// s = cap(z) / T, and ds/dz at z.
struct Scale {
  double softcap;
  double temperature;

  double capped(double z) const { return softcap > 0 ? softcap * std::tanh(z / softcap) : z; }
  double apply(double z) const { return capped(z) / temperature; }
  double derivative(double z) const {
    if (softcap > 0) {
      const double t = std::tanh(z / softcap);
      return (1.0 - t * t) / temperature;
    }
    return 1.0 / temperature;
  }
};

// log sum_j exp(s_j), max-subtracted.
double log_sum_exp(const double* s, int64_t n) {
  double m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
  if (std::isnan(m)) return NAN;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(s[j])) return NAN;
  }
  if (std::isinf(m)) return m;
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += std::exp(s[j] - m);
  return m + std::log(sum);
}

bool is_counted(const Problem& p, const lmloss_loss_options& o, int64_t t) {
  if (!p.labels.empty() && p.labels[t] == o.ignore_index) return false;
  if (!p.token_mask.empty() && p.token_mask[t] == 0) return false;
  return true;
}

}  // namespace

std::vector<double> logits(const Problem& p) {
  if (p.hidden == 0) {
    if (static_cast<int64_t>(p.logits.size()) != p.n_tokens * p.vocab) {
      throw std::invalid_argument("logits: size is not n_tokens * vocab");
    }
    return p.logits;
  }
  std::vector<double> z(p.n_tokens * p.vocab);  // (n_tokens, vocab)
  for (int64_t t = 0; t < p.n_tokens; ++t) {
    for (int64_t v = 0; v < p.vocab; ++v) {
      double acc = p.bias.empty() ? 0.0 : p.bias[v];
      for (int64_t h = 0; h < p.hidden; ++h) {
        acc += p.hidden_states[t * p.hidden + h] * p.weight[v * p.hidden + h];
      }
      z[t * p.vocab + v] = acc;
    }
  }
  return z;
}

LossResult loss(const Problem& p, const lmloss_loss_options& o,
                const std::vector<double>& grad_loss) {
  const int64_t n = p.n_tokens;
  const int64_t V = p.vocab;
  const int64_t K = p.top_k;
  const bool has_teacher = !p.teacher_ids.empty();
  const double alpha = o.ce_weight;
  const double beta = o.kd_weight;
  const double eps = o.label_smoothing;
  const double lambda = o.z_loss;
  const Scale scale{o.softcap, o.temperature};

  const std::vector<double> z = logits(p);  // (n_tokens, vocab)
  std::vector<double> s(z.size());          // scaled logits
  for (size_t i = 0; i < z.size(); ++i) s[i] = scale.apply(z[i]);

  LossResult r;
  r.lse.assign(n, 0.0);
  std::vector<double> l(n, 0.0);  // per-token loss
  int64_t counted = 0;
  for (int64_t t = 0; t < n; ++t) {
    const double* st = &s[t * V];
    r.lse[t] = log_sum_exp(st, V);
    if (!is_counted(p, o, t)) continue;
    ++counted;
    const double lse = r.lse[t];
    double lt = lambda != 0 ? lambda * lse * lse : 0;  // absent, as the sum below, at an infinite lse
    if (!p.labels.empty()) {
      check_id(p.labels[t], V, "labels");
      double ce = lse - (1 - eps) * st[p.labels[t]];
      if (eps != 0) {  // absent, not 0 times the sum: masked (-inf) logits make the sum infinite
        double sum_s = 0;
        for (int64_t j = 0; j < V; ++j) sum_s += st[j];
        ce -= (eps / V) * sum_s;
      }
      lt += alpha * ce;
    }
    if (has_teacher) {
      double kd = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t id = p.teacher_ids[t * K + k];
        check_id(id, V, "teacher_ids");
        const double P = p.teacher_probs[t * K + k];
        if (P == 0) continue;  // 0 log 0 = 0: an empty teacher entry contributes nothing
        kd += P * (std::log(P) - (st[id] - lse));
      }
      lt += beta * kd;
    }
    l[t] = lt;
  }

  // Reduction: D and the per-token weight of the upstream gradient.
  double D = 1;
  if (o.reduction == LMLOSS_REDUCTION_MEAN) {
    D = o.normalizer > 0 ? o.normalizer : static_cast<double>(counted);
  }
  const bool nothing_counted = counted == 0;
  if (o.reduction == LMLOSS_REDUCTION_NONE) {
    r.loss = l;
  } else {
    double sum = 0;
    for (int64_t t = 0; t < n; ++t) sum += l[t];
    r.loss = {nothing_counted ? 0.0 : sum / D};
  }

  // g_t = upstream * count_t / D.
  std::vector<double> g(n, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    if (nothing_counted || !is_counted(p, o, t)) continue;
    double up = 1;
    if (!grad_loss.empty()) up = o.reduction == LMLOSS_REDUCTION_NONE ? grad_loss[t] : grad_loss[0];
    g[t] = up / D;
  }

  // dL/dz, dense.
  r.grad_logits.assign(n * V, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    if (g[t] == 0) continue;
    const double* st = &s[t * V];
    const double lse = r.lse[t];
    double teacher_mass = 0;
    if (has_teacher) {
      for (int64_t k = 0; k < K; ++k) teacher_mass += p.teacher_probs[t * K + k];
    }
    for (int64_t j = 0; j < V; ++j) {
      const double pj = std::exp(st[j] - lse);
      double ds = 0;
      if (!p.labels.empty()) {
        const double onehot = j == p.labels[t] ? 1.0 : 0.0;
        ds += alpha * (pj - (1 - eps) * onehot - eps / V);
      }
      if (lambda != 0) ds += 2 * lambda * lse * pj;
      if (has_teacher) {
        double at_j = 0;
        for (int64_t k = 0; k < K; ++k) {
          if (p.teacher_ids[t * K + k] == j) at_j += p.teacher_probs[t * K + k];
        }
        ds += beta * (pj * teacher_mass - at_j);
      }
      r.grad_logits[t * V + j] = g[t] * ds * scale.derivative(z[t * V + j]);
    }
  }

  if (p.hidden > 0) {
    const int64_t H = p.hidden;
    r.grad_hidden.assign(n * H, 0.0);
    r.grad_weight.assign(V * H, 0.0);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t j = 0; j < V; ++j) {
        const double dz = r.grad_logits[t * V + j];
        for (int64_t h = 0; h < H; ++h) {
          r.grad_hidden[t * H + h] += dz * p.weight[j * H + h];
          r.grad_weight[j * H + h] += dz * p.hidden_states[t * H + h];
        }
      }
    }
    if (!p.bias.empty()) {
      r.grad_bias.assign(V, 0.0);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t j = 0; j < V; ++j) r.grad_bias[j] += r.grad_logits[t * V + j];
      }
    }
  }
  return r;
}

TopkResult topk(const Problem& p, const lmloss_topk_options& o) {
  const int64_t n = p.n_tokens;
  const int64_t V = p.vocab;
  const int64_t k = o.k;
  if (k < 1 || k > V) throw std::invalid_argument("options.k: outside [1, vocab]");
  const Scale scale{o.softcap, o.temperature};
  const std::vector<double> z = logits(p);

  TopkResult r;
  r.ids.assign(n * k, 0);
  r.probs.assign(n * k, 0.0);
  r.tail.assign(n, 0.0);
  std::vector<double> s(V);
  std::vector<int64_t> order(V);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < V; ++j) s[j] = scale.apply(z[t * V + j]);
    std::iota(order.begin(), order.end(), int64_t{0});
    // Descending value, ties to the lower id.
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return s[a] > s[b]; });
    const double lse = log_sum_exp(s.data(), V);
    double selected_lse = -INFINITY;
    {
      std::vector<double> top(k);
      for (int64_t i = 0; i < k; ++i) top[i] = s[order[i]];
      selected_lse = log_sum_exp(top.data(), k);
    }
    double mass = 0;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t id = order[i];
      r.ids[t * k + i] = static_cast<int32_t>(id);
      const double prob = std::exp(s[id] - (o.renormalize ? selected_lse : lse));
      r.probs[t * k + i] = prob;
      mass += prob;
    }
    r.tail[t] = o.renormalize ? 0.0 : 1.0 - mass;
  }
  return r;
}

double relative_error(const std::vector<double>& out, const std::vector<double>& ref) {
  if (out.size() != ref.size()) return INFINITY;
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i]) && out[i] == ref[i]) continue;  // an infinity (a masked row's lse) matched
    const double d = out[i] - ref[i];
    diff += d * d;
    norm += ref[i] * ref[i];
  }
  if (std::isnan(diff)) return NAN;
  return norm > 0 ? std::sqrt(diff) / std::sqrt(norm) : std::sqrt(diff);
}

}  // namespace lmloss::reference
