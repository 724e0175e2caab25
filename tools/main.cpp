// The `lmloss` command: `check` runs every operation against the float64 reference, `bench`
// times the fused head against the naive one and the bare products.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "bench.hpp"
#include "commands.hpp"
#include "lmloss/lmloss.h"

int main(int argc, char** argv) {
  using namespace lmloss::tools;
  CLI::App app{"lmloss: cross-entropy and top-k distillation at the head of a language model"};
  app.require_subcommand(1);
  app.set_version_flag("--version", [] {
    const int v = lmloss_version();
    return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
           std::to_string(v % 100);
  });

  CheckOptions check;
  CLI::App* check_cmd = app.add_subcommand(
      "check",
      "Run every operation on each available backend and dtype against the float64 reference.");
  check_cmd->footer(std::string(
      "Operations: cross-entropy from logits and through the head (forward, backward, fused, and\n"
      "the gradient in place over the logits), distillation mixed with cross-entropy through the\n"
      "head, and top-k from logits and through the head, renormalised and not. One random problem\n"
      "(67 tokens, vocabulary 1001, hidden 48, top-k 8) with label smoothing, z-loss,\n"
      "soft-capping, temperature, ignored and masked tokens on, split into several chunks by\n"
      "the budget.\n"
      "Error: the largest ||out - ref|| / ||ref|| over an operation's outputs (top-k ids are\n"
      "compared through the reference logits they select). Tolerance by input dtype: " +
      check_tolerances_text() +
      ".\nExit status 0 iff every operation passed on every backend run."));
  check_cmd->add_option("--backend", check.backend, "cpu, cuda or all")
      ->check(CLI::IsMember({"cpu", "cuda", "all"}))
      ->capture_default_str();
  check_cmd
      ->add_option("--dtype", check.dtypes,
                   "dtypes to run (default: f64 f32 bf16 f16 on the CPU, f32 bf16 f16 on CUDA)")
      ->check(CLI::IsMember({"f64", "f32", "bf16", "f16"}));
  check_cmd->add_option("--budget-bytes", check.budget_bytes,
                        "workspace budget of the calls (default: small enough for several chunks)");
  check_cmd->add_option("--seed", check.seed, "seed of the random problem")->capture_default_str();

  BenchOptions bench;
  CLI::App* bench_cmd = app.add_subcommand(
      "bench",
      "Time the fused loss head (loss, dX, dW) against the naive one and the bare products.");
  bench_cmd->footer(
      "Paths, on one backend:\n"
      "  lmloss  the fused call: loss, dX and dW, logits a chunk at a time within the budget;\n"
      "  naive   the full logits: one product to an f32 (tokens, vocab) buffer, lmloss's logits\n"
      "          path for loss and gradient into a separate (tokens, vocab) buffer, then the two\n"
      "          backward products dX = dZ W and dW = dZ^T X;\n"
      "  floor   the three bare products of the same shapes (bf16/f16 inputs: f32 copies made\n"
      "          outside the timing on the CPU, used by the naive path too).\n"
      "After one warm-up of each, --repeats rounds run the three paths in turn (so a change of\n"
      "load falls on all of them); the median and the minimum of each are reported, with their\n"
      "ratio to the floor's, and the median of the process's CPU time (with --threads 1 a measure\n"
      "of work that other load on the machine barely disturbs).\n"
      "Peak extra memory: lmloss, its peak workspace; naive, its two (tokens, vocab) buffers\n"
      "plus the workspace of its row pass (and, for bf16/f16 on the CPU, the f32 copies of X\n"
      "and W its products need).\n"
      "Errors are against a float64 reference: logits X W^T in double from the same rounded\n"
      "inputs, loss and dZ by the float64 reference of the tests, dX and dW by double products;\n"
      "loss_rel_err = |loss - ref| / |ref|, grad_rel_err = max over dX and dW of\n"
      "||d - ref|| / ||ref||. The reference costs about three double-precision products of the\n"
      "problem; --verify auto skips it above 2e11 flops per product. Exit status 1 when a path\n"
      "is off the reference by more than the tolerance `lmloss check` uses for the dtype.");
  std::vector<std::string> preset_names;
  std::string preset_help;
  for (const lmloss::tools::BenchPreset& p : lmloss::tools::kBenchPresets) {
    preset_names.push_back(p.name);
    preset_help += (preset_help.empty() ? "" : ", ") + std::string(p.name) + " (N " + std::to_string(p.tokens) +
                   ", H " + std::to_string(p.hidden) + ", V " + std::to_string(p.vocab) + ")";
  }
  bench_cmd->add_option("--preset", bench.preset, preset_help)
      ->check(CLI::IsMember(preset_names))
      ->capture_default_str();
  bench_cmd->add_option("--tokens", bench.tokens, "tokens N (default: the preset's)")
      ->check(CLI::PositiveNumber);
  bench_cmd->add_option("--hidden", bench.hidden, "hidden size H (default: the preset's)")
      ->check(CLI::PositiveNumber);
  bench_cmd->add_option("--vocab", bench.vocab, "vocabulary V (default: the preset's)")
      ->check(CLI::PositiveNumber);
  bench_cmd->add_option("--dtype", bench.dtype, "input dtype")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))
      ->capture_default_str();
  bench_cmd
      ->add_option("--loss", bench.loss,
                   "ce: cross-entropy; distill: top-k distillation (teacher of --top-k random "
                   "ids and probabilities, ce_weight 0, kd_weight 1)")
      ->check(CLI::IsMember({"ce", "distill"}))
      ->capture_default_str();
  bench_cmd->add_option("--backend", bench.backend, "cpu, cuda or auto (cuda when available)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  bench_cmd->add_option("--budget-mib", bench.budget_mib,
                        "lmloss workspace budget in MiB (default: the library's, 1024)");
  bench_cmd->add_option("--repeats", bench.repeats, "timed runs per path, after one warm-up")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  bench_cmd->add_option("--threads", bench.threads, "CPU threads (0: all cores)")
      ->capture_default_str();
  bench_cmd->add_option("--top-k", bench.top_k, "teacher entries per token for --loss distill")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  bench_cmd
      ->add_option("--verify", bench.verify,
                   "float64 reference: on, off, or auto (on when tokens*vocab*hidden <= 2e11)")
      ->check(CLI::IsMember({"on", "off", "auto"}))
      ->capture_default_str();
  bench_cmd->add_option("--json", bench.json_path, "write the results as JSON to this file");
  bench_cmd->add_option("--seed", bench.seed, "seed of the random problem")->capture_default_str();

  CLI11_PARSE(app, argc, argv);
  try {
    if (check_cmd->parsed()) return run_check(check);
    if (bench_cmd->parsed()) return run_bench(bench);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lmloss: %s\n", e.what());
    return 1;
  }
  return 1;
}
