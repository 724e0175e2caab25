#!/usr/bin/env python3
"""Plots lmloss's fused fwd+bwd time against its workspace budget, beside the peers' points.

Reads a modes record with curve rows (bench_cuda_modes --budgets-gib ... --json) and a peers
record (bench/peers.py --json); writes a PNG. The x axis is the peak device memory beyond the
inputs and the gradients, so every method is charged only for what it adds; the y axis is the
step's time over the floor (the bare products of the same step, timed in the same run). Needs
matplotlib (pip install matplotlib).

  python3 bench/plot_curve.py bench/cuda_h200_llama3-8b.json bench/peers_h200.json docs/budget_curve.png
"""
import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Peers' rows by their method name in bench/peers.py; lmloss there is the PyTorch layer.
NAMES = {"lmloss": "lmloss.torch, 1 GiB budget"}
GRADS_GIB = {"llama3-8b": (8192 * 4096 + 128256 * 4096) * 2 / 2**30}  # bf16 dX and dW


def main(modes_path, peers_path, out_path, preset="llama3-8b"):
    modes = json.load(open(modes_path))
    peers = json.load(open(peers_path))
    curve = sorted((r for r in modes["rows"] if r["mode"] == "curve"), key=lambda r: r["budget_gib"])
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    ax.plot([r["peak_gib"] for r in curve], [r["ms"] / r["floor_ms"] for r in curve], "o-", color="C0",
            label="lmloss (exact), workspace budget 0.125-4 GiB")
    for r in curve:
        ax.annotate(f"{r['budget_gib']:g}", (r["peak_gib"], r["ms"] / r["floor_ms"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=7, color="C0")
    markers = {"naive": "s", "torch.compile": "D", "liger": "^", "cce": "v", "cce-exact": "x"}
    # Timed rows only: with --accuracy, peers.py adds rows of errors alone. A method timed in
    # several rounds (--rounds) is one point: the medians of its rounds.
    by_method = {}
    for p in peers["rows"]:
        if p["preset"] == preset and p["mode"] == "fwd_bwd" and "ms" in p:
            by_method.setdefault(p["method"], []).append(p)
    for i, (method, rounds) in enumerate(by_method.items()):
        ms = statistics.median(r["ms"] for r in rounds)
        ratio = statistics.median(r["ms"] / r["floor_ms"] for r in rounds)
        extra = max(statistics.median(r["peak_gib"] for r in rounds) - GRADS_GIB[preset], 0.01)
        ax.plot([extra], [ratio], markers.get(method, "o"), color=f"C{i + 1}",
                label=f"{NAMES.get(method, method)} ({ms:.1f} ms)")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("peak memory beyond inputs and gradients (GiB, log scale)")
    ax.set_ylabel("time / floor (three bare products)")
    ax.set_title(f"{preset}, N {modes['tokens']}, bf16, fused fwd+bwd (dX, dW): {modes['device']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
