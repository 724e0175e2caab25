// The float64 reference: docs/contract.md written as code. Naive loops, no fusion, double
// everywhere, the full logits held in memory. Every backend is checked against it, and the
// `lmloss check` command uses it too. Speed is not a goal here; obviousness is.
#pragma once

#include <cstdint>
#include <vector>

#include "lmloss/lmloss.h"

namespace lmloss::reference {

// A problem in double precision, contiguous rows.
struct Problem {
  int64_t n_tokens = 0;
  int64_t vocab = 0;
  int64_t hidden = 0;                 // 0: `logits` holds the logits; else hidden/weight/bias
  std::vector<double> logits;         // (n_tokens, vocab)
  std::vector<double> hidden_states;  // (n_tokens, hidden)
  std::vector<double> weight;         // (vocab, hidden)
  std::vector<double> bias;           // (vocab), empty: none
  std::vector<int64_t> labels;        // (n_tokens), empty: none
  int64_t top_k = 0;
  std::vector<int64_t> teacher_ids;   // (n_tokens, top_k), empty: none
  std::vector<double> teacher_probs;  // (n_tokens, top_k)
  std::vector<uint8_t> token_mask;    // (n_tokens), empty: none
};

struct LossResult {
  std::vector<double> loss;         // 1 value (mean, sum) or n_tokens (none)
  std::vector<double> lse;          // (n_tokens)
  std::vector<double> grad_logits;  // (n_tokens, vocab)
  std::vector<double> grad_hidden;  // (n_tokens, hidden), linear problems
  std::vector<double> grad_weight;  // (vocab, hidden), linear problems
  std::vector<double> grad_bias;    // (vocab), when the problem has a bias
};

// Loss, lse and every gradient. grad_loss: empty = 1; one value (mean, sum) or n_tokens (none).
// Gradients with LMLOSS_ACCUMULATE_* flags are returned as the plain gradient: the caller adds.
LossResult loss(const Problem& problem, const lmloss_loss_options& options,
                const std::vector<double>& grad_loss = {});

// The logits z = X W^T + b, or the given ones: (n_tokens, vocab).
std::vector<double> logits(const Problem& problem);

struct TopkResult {
  std::vector<int32_t> ids;   // (n_tokens, k)
  std::vector<double> probs;  // (n_tokens, k)
  std::vector<double> tail;   // (n_tokens)
};

TopkResult topk(const Problem& problem, const lmloss_topk_options& options);

// ||out - ref|| / ||ref|| (2-norms); ||out - ref|| when ref is all zero.
double relative_error(const std::vector<double>& out, const std::vector<double>& ref);

}  // namespace lmloss::reference
