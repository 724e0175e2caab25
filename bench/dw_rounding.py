"""How far a bf16 weight gradient drifts from float64 when it is rounded after every chunk of
tokens, against rounded once: an emulation in NumPy of the roundings alone (no GPU needed).

    python3 bench/dw_rounding.py --tokens 8192 --vocab 128256 --hidden 64 --chunk-rows 2816

dW = G^T X summed over the token chunks, G = (softmax - one-hot) / N, on the benchmarks' data
(X standard normal, W of spread 2 / sqrt(H), uniform labels), inputs and G's soft part in bf16 as
the products take them, products summed exactly. Rows:
  naive bf16      G rounded to bf16 whole, one product, its f32 sum rounded once (PyTorch's path)
  rounded once    the f32 sum over the chunks rounded once (LMLOSS_SUM_GRAD_WEIGHT_IN_F32, the CPU)
  per chunk       the bf16 dW read, the chunk's product added, rounded: once a chunk
  per chunk x2    as per chunk, the one-hot term added and rounded apart (the exponential form)
  bf16 + b bits   a sum kept as its bf16 value and a b-bit integer rest in units of that value's
                  ulp / (2^b - 2) (8 or 4 bits: a tail of 1 or 1/2 byte an entry, not an f32
                  sum's 2 beyond the gradient's own), rebuilt, added to and split again a chunk,
                  rounded once at the end (--rest-bits, one row each; in brackets the kept sum's
                  own error before that rounding, beside the unrounded f32 sum's)
Each element's error depends on its own sum, not on H, so a small H stands for a model's.
With --library (needs lmloss and PyTorch) the same data also goes through the CPU library once a
chunk, adding into a bf16 dW (LMLOSS_ACCUMULATE_GRAD_WEIGHT; each call rounds its f32 sum once):
the library's own arithmetic, rounded per chunk as CUDA does within one call.

--forms emulates instead a dW accumulated in f32 (no rounding of the sum) on CUDA's two forms of
the bf16 gradient, each rounding alone and together, on bench/peers.py's inputs (needs PyTorch):

    python3 bench/dw_rounding.py --forms --data peaked --tokens 2048 --vocab 32768 --hidden 1024

  gradient form   softmax - one-hot rounded to bf16 (the row kernel's dZ), the label's term too
  exp(s - s_y)    the statistics product's stored bf16 values E, then the one-hot term exactly
  f X             each row of X times its factor exp(s_y - lse) / N, rounded to bf16 for dW
  both            the exponential form as run: E and f X both rounded
  f16 gradient    the gradient form in f16: what three more bits would give
With --exact-above T1,T2,... each threshold T adds two rows where the entries with a probability
or gradient of at least T are taken exactly and only the rest rounded (a sparse correction beside
the products: at most 1/T entries a row, as a row's probabilities sum to 1, plus its label):
  gradient form, T   the gradient form's entries of |p - y| >= T exact
  both, T            the exponential form as run, its entries of p >= T exact
and the mean and largest count of such entries a row.
Logits are float32 sums as the products leave them. "peaked" needs an H of ~1000 for its lifted
tokens to stand apart (W's rows nearly orthogonal); "random" is the benchmarks' flat softmax.
"""

import argparse
import time
from fractions import Fraction

import numpy as np


def bf16(a):
    """a rounded to the nearest bf16 (ties to even), as float32."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def split_sum(total, bits):
    """total, first rounded to f32 as a product's epilogue holds it, as its bf16 value and the rest:
    an integer of `bits` bits (symmetric, |rest| < 2^(bits-1)) in units of rest_unit(high, bits)."""
    total = np.asarray(total, np.float32)
    high = bf16(total)
    rest = np.rint((total.astype(np.float64) - high) / rest_unit(high, bits))
    return high, rest


def joined_sum(high, rest, bits):
    return high.astype(np.float64) + rest * rest_unit(high, bits)


def rest_unit(high, bits):
    """The rest's unit: the bf16 value's ulp over 2^bits - 2, so that a rest of at most half an ulp
    takes the 2^bits - 1 integers from -(2^(bits-1) - 1) to 2^(bits-1) - 1."""
    return ulp_bf16(high) / (2.0 ** bits - 2)


def ulp_bf16(values):
    """The spacing of bf16 values at each of `values` (bf16 already): 8 significant bits, the
    subnormals' 2^-133 below."""
    _, exponent = np.frexp(values.astype(np.float64))
    return np.where(values == 0, 2.0 ** -133, np.maximum(np.ldexp(1.0, exponent - 8), 2.0 ** -133))


def relative_error(out, ref):
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def make_inputs(n, v, h, seed=0):
    rng = np.random.default_rng(seed)
    x = bf16(rng.standard_normal((n, h), dtype=np.float32))
    w = bf16(rng.standard_normal((v, h), dtype=np.float32) * np.float32(2.0 / np.sqrt(h)))
    return x, w, rng.integers(0, v, n)


def emulate(n, v, h, chunk_rows, seed=0, rest_bits=()):
    x, w, y = make_inputs(n, v, h, seed)
    kept = {bits: (np.zeros((v, h), np.float32), np.zeros((v, h))) for bits in rest_bits}
    exact = np.zeros((v, h))       # float64 sum of the exact G
    summed = np.zeros((v, h))      # the products' sums, not rounded
    naive = np.zeros((v, h))
    per_chunk = np.zeros((v, h), np.float32)
    per_chunk_x2 = np.zeros((v, h), np.float32)
    for r0 in range(0, n, chunk_rows):
        xc = x[r0:r0 + chunk_rows]
        yc = y[r0:r0 + chunk_rows]
        x64 = xc.astype(np.float64)
        p = xc @ w.T
        p -= p.max(axis=1, keepdims=True)
        np.exp(p, out=p)
        p /= p.sum(axis=1, keepdims=True)
        one_hot = np.zeros((v, h))
        np.add.at(one_hot, yc, -x64 / n)
        soft = bf16(p / n).T.astype(np.float64) @ x64
        exact += (p / n).T.astype(np.float64) @ x64 + one_hot
        summed += soft + one_hot
        per_chunk = bf16(per_chunk + soft + one_hot)
        per_chunk_x2 = bf16(bf16(per_chunk_x2 + soft) + one_hot)
        for bits, (high, rest) in kept.items():
            kept[bits] = split_sum(joined_sum(high, rest, bits) + soft + one_hot, bits)
        p[np.arange(len(yc)), yc] -= 1.0
        p /= n
        naive += bf16(p).T.astype(np.float64) @ x64
    return dict(exact=exact, chunks=-(-n // chunk_rows), naive=relative_error(bf16(naive), exact),
                once=relative_error(bf16(summed), exact), per_chunk=relative_error(per_chunk, exact),
                per_chunk_x2=relative_error(per_chunk_x2, exact),
                f32_sum=relative_error(summed, exact),
                rest={bits: relative_error(bf16(joined_sum(high, rest, bits)), exact)
                      for bits, (high, rest) in kept.items()},
                rest_sum={bits: relative_error(joined_sum(high, rest, bits), exact)
                          for bits, (high, rest) in kept.items()})


def library_per_chunk(n, v, h, chunk_rows, seed=0):
    """The CPU library's bf16 dW over the same data, one call a chunk adding into it."""
    import torch
    from lmloss import _api
    x, w, y = (torch.from_numpy(a) for a in make_inputs(n, v, h, seed))
    x, w = x.bfloat16(), w.bfloat16()
    opts = _api.loss_options(reduction="mean", ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                             softcap=None, temperature=1.0, normalizer=float(n))
    dw = torch.zeros(v, h, dtype=torch.bfloat16)
    for r0 in range(0, n, chunk_rows):
        xc = x[r0:r0 + chunk_rows]
        _api.invoke_loss("forward_backward", -1, hidden=xc, weight=w, labels=y[r0:r0 + chunk_rows],
                         loss=torch.empty(()), lse=torch.empty(xc.shape[0]), grad_hidden=torch.empty_like(xc),
                         grad_weight=dw, accumulate_grad_weight=r0 > 0, **opts)
    return dw.float().numpy()


def emulate_forms(n, v, h, data, seed=0, block_rows=512, exact_above=()):
    """Relative errors against float64 of a dW accumulated in f32 from each form's roundings; for
    each threshold in exact_above also the two forms with their entries above it exact, and the
    mean and largest count of those entries a row ("entries" maps each threshold to the pair)."""
    import torch
    import peers
    x, w, y, _, _ = peers.make_inputs(n, h, v, torch.bfloat16, seed=seed, data=data, device="cpu")
    x, w, y = x.float().numpy(), w.float().numpy(), y.numpy()
    names = ("gradient form", "exp(s - s_y)", "f X", "both", "f16 gradient")
    names += tuple(f"{form}, {t:g}" for t in exact_above for form in ("gradient form", "both"))
    sums = {k: np.zeros((v, h)) for k in ("exact",) + names}
    counts = {t: [0, 0] for t in exact_above}  # entries a row above t: total, largest
    label_term = np.zeros((v, h))  # the one-hot term, exact: added once at the end
    for r0 in range(0, n, block_rows):
        xc, yc = x[r0:r0 + block_rows], y[r0:r0 + block_rows]
        rows = np.arange(len(yc))
        x64 = xc.astype(np.float64)
        s = (xc @ w.T).astype(np.float64)  # float32 sums, as the products leave them
        lse = s.max(axis=1, keepdims=True)
        lse += np.log(np.exp(s - lse).sum(axis=1, keepdims=True))
        p = np.exp(s - lse)
        grad = p.copy()
        grad[rows, yc] -= 1.0
        np.add.at(label_term, yc, -x64 / n)
        stored = np.exp(s - s[rows, yc][:, None])  # exp(s - s_y): 1 at the label
        factor = np.exp(s[rows, yc][:, None] - lse) / n
        stored16, fx16 = bf16(stored).astype(np.float64), bf16(factor * x64).astype(np.float64)
        sums["exact"] += grad.T @ x64 / n
        sums["gradient form"] += bf16(grad).astype(np.float64).T @ x64 / n
        sums["exp(s - s_y)"] += stored16.T @ (factor * x64)
        sums["f X"] += stored.T @ fx16
        sums["both"] += stored16.T @ fx16
        sums["f16 gradient"] += grad.astype(np.float16).astype(np.float64).T @ x64 / n
        for t in exact_above:
            kept = np.abs(grad) >= t
            sums[f"gradient form, {t:g}"] += np.where(kept, grad, bf16(grad)).T @ x64 / n
            # The exponential form's terms of the kept entries taken out and added exactly.
            kept = p >= t
            rounded = np.where(kept, 0.0, stored16)
            sums[f"both, {t:g}"] += rounded.T @ fx16 + np.where(kept, p, 0.0).T @ x64 / n
            per_row = (kept | (np.abs(grad) >= t)).sum(axis=1)
            counts[t][0] += int(per_row.sum())
            counts[t][1] = max(counts[t][1], int(per_row.max()))
    for k in ("exp(s - s_y)", "f X", "both") + tuple(f"both, {t:g}" for t in exact_above):
        sums[k] += label_term
    errors = {k: relative_error(sums[k], sums["exact"]) for k in names}
    errors["entries"] = {t: (total / n, largest) for t, (total, largest) in counts.items()}
    return errors


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--chunk-rows", default="2816", help="comma list: one emulation each")
    ap.add_argument("--library", action="store_true", help="also the CPU library, called once a chunk")
    ap.add_argument("--rest-bits", default="",
                    help="comma list, e.g. 8,4: the sum kept as bf16 and a rest of that many bits")
    ap.add_argument("--forms", action="store_true",
                    help="an f32 dW on CUDA's two gradient forms instead")
    ap.add_argument("--data", choices=("random", "peaked"), default="random",
                    help="with --forms: bench/peers.py's inputs of that kind")
    ap.add_argument("--exact-above", default="",
                    help="with --forms: comma list of thresholds, e.g. 1/16,1/64: the two "
                         "forms with their entries above each threshold exact")
    args = ap.parse_args()
    print("# relative error of dW against float64 (norm of the difference / norm)")
    if args.forms:
        t0 = time.time()
        thresholds = [float(Fraction(t)) for t in args.exact_above.split(",") if t]
        e = emulate_forms(args.tokens, args.vocab, args.hidden, args.data, exact_above=thresholds)
        entries = e.pop("entries")
        forms = "  ".join(f"{k} {e[k]:.2e}" for k in e)
        print(f"N {args.tokens} V {args.vocab} H {args.hidden}, {args.data}, dW in f32, rounded: "
              f"{forms}  ({time.time() - t0:.0f} s)", flush=True)
        for t, (mean, largest) in entries.items():
            print(f"  entries of {t:g} or more a row: mean {mean:.2f}, largest {largest}")
        return
    rest_bits = [int(b) for b in args.rest_bits.split(",") if b]
    for rows in map(int, args.chunk_rows.split(",")):
        t0 = time.time()
        e = emulate(args.tokens, args.vocab, args.hidden, rows, rest_bits=rest_bits)
        kept = "".join(f"bf16 + {bits} bits {err:.2e} (the sum {e['rest_sum'][bits]:.1e})  "
                       for bits, err in e["rest"].items())
        print(f"N {args.tokens} V {args.vocab} H {args.hidden}, {e['chunks']} chunks of {rows} rows: "
              f"naive bf16 {e['naive']:.2e}  rounded once {e['once']:.2e}  per chunk {e['per_chunk']:.2e}  "
              f"per chunk x2 {e['per_chunk_x2']:.2e}  {kept}(unrounded {e['f32_sum']:.1e}; "
              f"{time.time() - t0:.0f} s)", flush=True)
        if args.library:
            t0 = time.time()
            dw = library_per_chunk(args.tokens, args.vocab, args.hidden, rows)
            print(f"  the CPU library, a call a chunk into a bf16 dW: {relative_error(dw, e['exact']):.2e}"
                  f" ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
