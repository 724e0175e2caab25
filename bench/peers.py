#!/usr/bin/env python3
"""The peers of lmloss on one GPU, timed the way `lmloss bench` times it.

For each preset and mode: naive PyTorch (F.cross_entropy(h @ W.T)), torch.compile of it, Liger
Kernel's LigerFusedLinearCrossEntropyLoss and Cut Cross-Entropy's linear_cross_entropy (default
gradient filtering, and exact with filter_eps=None), and lmloss itself (lmloss.torch, and
lmloss.topk for top-k; for fwd+bwd also its fused op alone, "lmloss-op", and lmloss.torch with
its 16-bit dW summed in a float32 tensor of its own, "lmloss-f32dw", its eager step with every
dW product added into the kept sum in the step, "lmloss-nodefer", and its bf16 dW's sum kept in
float32 where it would be kept as bf16 values and 8-bit rests, "lmloss-f32sum"), when they
import.
Each row: median time of CUDA events around the step (L2 flushed before every run), the peak
extra device memory over the inputs (gradients included), and the floor: the bare torch.matmul
products of the same step (forward; + dX; + dW) timed right before the method, on the card as the
method finds it (a card warmed by the methods before runs slower; timed once for all, the floor
favoured the first methods). With --rounds R the methods run R times, in reverse order every
other round, a row for each. With --accuracy the cross-entropy steps are also compared with a
float64 reference of the same bf16 inputs (loss, dX, dW; relative error of the norm), and so are
lmloss's dW in float32 and in bf16, rounded once and after each token chunk. With
--profile each step's kernels are summed by name from one run under torch.profiler. With
--host each step's host time is measured with the GPU kept busy, and in a synchronous run the
GPU's wait for its first kernel and its idle gaps between kernels (CUPTI). With
--launch-ahead MS a sleep kernel of about MS ms goes before each timed run, so that the host's
work before a step's first kernel (dispatch, allocation, a compiled graph's guards) overlaps it as
in a training loop, where the host runs ahead, and the events time the GPU's work alone; without
it they time that host work too. With --clocks the SM clock is sampled (NVML) while each timed
run is on the device: each row gets the median clock of its runs and of its floor's, and how many
runs the power limit or heat held back, as `bench_cuda_modes --clocks 1` gives them (a card at
its power limit runs a step at the clock its energy allows), and where the driver counts energy,
the joules of a run and the mean power over back-to-back runs of at least 2 s after the timed ones
(the driver's power readings trail the load: a single run's says little). With --data peaked the
inputs are shaped like a trained head's (a few plausible tokens a row, common ones in many rows)
instead of random (flat softmaxes): CCE's time depends on it, through the gradient blocks it
filters; the other methods' cross-entropy steps do not. --lmloss-budget-gib sets lmloss's
workspace budget (fewer, larger token chunks at a larger one). Prints a table and writes JSON.

  python3 bench/peers.py --presets llama3-8b,gemma2-2b --json peers.json
"""
import argparse
import ctypes
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

PRESETS = {
    "small": (512, 1024, 32000),
    "llama3-8b": (8192, 4096, 128256),
    "gemma2-2b": (8192, 2304, 256000),
}
# mode -> (needs dX, needs dW, products in the floor)
MODES = {
    "fwd_bwd": (True, True, 3),
    "dx_only": (True, False, 2),
    "forward": (False, False, 1),
    "distill64": (True, True, 3),
    "topk64": (False, False, 1),
    "topk2048": (False, False, 1),
}

_flush = None
_launch_ahead_cycles = 0  # --launch-ahead: a sleep kernel's cycles queued before each timed run
_clock_probe = None  # --clocks: a ClockProbe


class ClockProbe:
    """The SM clock of the current CUDA device and whether the power limit or heat is holding it
    back, and the energy it has spent, from NVML (loaded at run time; `ok` is False where it does
    not answer)."""

    SM_CLOCK = 1  # NVML_CLOCK_SM
    # Software power cap, hardware slowdown, software and hardware thermal slowdown, power brake.
    HELD_BACK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80

    def __init__(self):
        self.ok = False
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        try:  # no NVML, one without these entry points, or a PyTorch that names no PCI bus
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            self._clock = nvml.nvmlDeviceGetClockInfo
            self._reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                nvml.nvmlDeviceGetCurrentClocksThrottleReasons
            self._energy = getattr(nvml, "nvmlDeviceGetTotalEnergyConsumption", None)
            by_bus = nvml.nvmlDeviceGetHandleByPciBusId_v2
            bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        except (OSError, AttributeError):
            return
        self._clock.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint)]
        self._reasons.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_ulonglong)]
        by_bus.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
        if self._energy is not None:
            self._energy.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_ulonglong)]
        self._device = ctypes.c_void_p()
        self.ok = nvml.nvmlInit_v2() == 0 and by_bus(bus.encode(), ctypes.byref(self._device)) == 0

    def sample(self):
        """(MHz, held back), or None where NVML does not answer."""
        mhz, reasons = ctypes.c_uint(), ctypes.c_ulonglong()
        if (self._clock(self._device, self.SM_CLOCK, ctypes.byref(mhz)) != 0
                or self._reasons(self._device, ctypes.byref(reasons)) != 0):
            return None
        return mhz.value, bool(reasons.value & self.HELD_BACK)

    def energy_mj(self):
        """Millijoules the device has spent since the driver loaded, or None."""
        mj = ctypes.c_ulonglong()
        if self._energy is None or self._energy(self._device, ctypes.byref(mj)) != 0:
            return None
        return mj.value


def flush_l2():
    global _flush
    if _flush is None:
        _flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    _flush.zero_()


STEADY_S = 2.0  # the least time of the back-to-back runs whose energy --clocks counts


def steady_energy(fn, run_ms):
    """(joules a run, mean watts) of fn() run back to back for at least STEADY_S, from the
    driver's energy counter; None where it does not count."""
    count = max(3, math.ceil(STEADY_S * 1000 / max(run_ms, 1e-3)))
    torch.cuda.synchronize()
    e0, t0 = _clock_probe.energy_mj(), time.perf_counter()
    if e0 is None:
        return None
    for _ in range(count):
        getattr(fn, "reset", lambda: None)()
        fn()
    torch.cuda.synchronize()
    e1, t1 = _clock_probe.energy_mj(), time.perf_counter()
    if e1 is None or t1 <= t0:
        return None
    return (e1 - e0) / 1000 / count, (e1 - e0) / 1000 / (t1 - t0)


def energy_note(joules, watts):
    return f", {joules:.2f} J at {watts:.0f} W" if joules is not None else ""


def timed(fn, repeats):
    """Median ms and peak extra bytes of fn() over `repeats` runs after one warm-up, and with
    --clocks (median MHz of the runs' medians, runs held back at some sample, and the joules of a
    run and mean watts of steady_energy, or None, None), else None."""
    fn()
    torch.cuda.synchronize()
    times, peak, run_mhz, held = [], 0, [], 0
    for _ in range(repeats):
        getattr(fn, "reset", lambda: None)()  # the last run's gradients are not the baseline
        flush_l2()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if _launch_ahead_cycles:
            torch.cuda._sleep(_launch_ahead_cycles)
        start.record()
        out = fn()
        stop.record()
        samples = []
        while _clock_probe is not None and not stop.query():
            # From the start event on: not the sleep kernel launched ahead of the run.
            sample = _clock_probe.sample() if start.query() else None
            if sample is not None:
                samples.append(sample)
            time.sleep(0.0005)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
        peak = max(peak, torch.cuda.max_memory_allocated() - base)
        if samples:
            run_mhz.append(statistics.median(mhz for mhz, _ in samples))
            held += any(h for _, h in samples)
        del out
    times.sort()
    clocks = None
    if run_mhz:
        clocks = (statistics.median(run_mhz), held,
                  *(steady_energy(fn, times[len(times) // 2]) or (None, None)))
    return times[len(times) // 2], peak, clocks


def sleep_cycles(ms):
    """Cycles of torch.cuda._sleep that keep the GPU busy for about `ms` milliseconds."""
    probe = 1 << 22
    torch.cuda._sleep(probe)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    stop.record()
    torch.cuda.synchronize()
    return int(probe * ms / start.elapsed_time(stop))


# --data peaked: each row lifts this many plausible tokens, drawn from a Zipf law of this exponent
# over the vocabulary (low ids common), this far above the rest of its logits (std ~2).
PLAUSIBLE_TOKENS = 16
ZIPF_EXPONENT = 1.1
PLAUSIBLE_LIFT = 18.0


def make_inputs(n, h, v, dtype, seed=0, data="random", device="cuda"):
    """Hidden states, head, labels, and a teacher's ids and probabilities. "random": logits of
    std ~2 around 0 and uniform labels, every softmax nearly flat. "peaked": shaped like a trained
    head's, where most of a row's probability lies on a few tokens and common tokens are plausible
    in many rows (the sparsity Cut Cross-Entropy's gradient filtering lives on); the label is one
    of the row's plausible tokens, drawn from the row's softmax over them."""
    g = torch.Generator(device=device).manual_seed(seed)
    if data == "random":
        x = torch.randn(n, h, device=device, dtype=dtype, generator=g)
        w = torch.randn(v, h, device=device, dtype=dtype, generator=g) * (2.0 / math.sqrt(h))
        y = torch.randint(0, v, (n,), device=device, generator=g)
    elif data == "peaked":
        x = torch.randn(n, h, device=device, generator=g)
        w = torch.randn(v, h, device=device, generator=g) * (2.0 / math.sqrt(h))
        zipf = torch.arange(1, v + 1, device=device, dtype=torch.float64).pow(-ZIPF_EXPONENT)
        plausible = torch.multinomial(zipf, n * PLAUSIBLE_TOKENS, replacement=True, generator=g)
        plausible = plausible.view(n, PLAUSIBLE_TOKENS).sort(1).values
        lift = PLAUSIBLE_LIFT + 1.5 * torch.randn(n, PLAUSIBLE_TOKENS, device=device, generator=g)
        lift[:, 1:] *= plausible[:, 1:] != plausible[:, :-1]  # a token drawn twice rises once
        # x . w_t rises by about the lift: W's rows are nearly orthogonal.
        for k in range(PLAUSIBLE_TOKENS):
            w_t = w[plausible[:, k]]
            x += (lift[:, k] / w_t.pow(2).sum(1))[:, None] * w_t
        # The label drawn from the row's own softmax, as from a calibrated model's.
        pick = torch.multinomial(torch.softmax(lift, 1), 1, generator=g)
        y = plausible.gather(1, pick).view(n)
        x, w = x.to(dtype), w.to(dtype)
    else:
        raise ValueError(f"unknown data {data!r}: random or peaked")
    base = torch.randint(0, v, (n, 1), device=device, generator=g)
    ids = (base + 7919 * torch.arange(64, device=device)) % v  # distinct per row
    p = torch.rand(n, 64, device=device, generator=g) + 1e-3
    p = p / p.sum(1, keepdim=True)
    return x, w, y, ids, p


def naive_ce(x, w, y):
    return F.cross_entropy((x @ w.T).float(), y)


def naive_distill(x, w, ids, p):
    logp = torch.log_softmax((x @ w.T).float(), dim=-1)
    return (p * (torch.log(p) - logp.gather(1, ids))).sum(1).mean()


def step(loss_fn, x, w, want_dx, want_dw):
    """A closure: the loss and the gradients the mode asks for (none: no autograd)."""
    if not (want_dx or want_dw):
        def run():
            with torch.no_grad():
                return loss_fn(x, w)
        return run
    xg = x.detach().requires_grad_(want_dx)
    wg = w.detach().requires_grad_(want_dw)

    def reset():
        xg.grad = None
        wg.grad = None

    def run():
        reset()
        loss = loss_fn(xg, wg)
        loss.backward()
        return loss, xg.grad, wg.grad
    run.reset = reset
    return run


def floor_fn(x, w, count):
    def run():
        z = x @ w.T
        outs = [z]
        if count >= 2:
            outs.append(z @ w)
        if count >= 3:
            outs.append(z.T @ x)
        return outs
    return run


def methods(mode, y, ids, p):
    """name -> loss_fn(x, w), for the peers that import."""
    out = {}
    if mode.startswith("topk"):
        k = int(mode[4:])
        def topk(x, w):
            values, index = torch.topk((x @ w.T).float(), k, dim=-1)
            return torch.softmax(values, -1), index
        out["naive"] = topk
        return out
    if mode == "distill64":
        out["naive"] = lambda x, w: naive_distill(x, w, ids, p)
        out["torch.compile"] = torch.compile(lambda x, w: naive_distill(x, w, ids, p))
        return out
    out["naive"] = lambda x, w: naive_ce(x, w, y)
    out["torch.compile"] = torch.compile(lambda x, w: naive_ce(x, w, y))
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
        out["liger"] = lambda x, w: liger(w, x, y)
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"# liger-kernel not available: {e}", file=sys.stderr)
    try:
        from cut_cross_entropy import linear_cross_entropy
        out["cce"] = lambda x, w: linear_cross_entropy(x, w, y)
        out["cce-exact"] = lambda x, w: linear_cross_entropy(x, w, y, filter_eps=None)
    except Exception as e:  # noqa: BLE001
        print(f"# cut-cross-entropy not available: {e}", file=sys.stderr)
    return out


def lmloss_methods(mode, y, ids, p):
    """lmloss.torch's losses, when the package imports (it runs on torch's stream and allocator)."""
    try:
        import lmloss
        import lmloss.torch as lt
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"# lmloss not available: {e}", file=sys.stderr)
        return {}
    if mode == "distill64":
        return {"lmloss": lambda x, w: lt.linear_distill(x, w, ids, p)}
    if mode.startswith("topk"):
        k = int(mode[4:])
        return {"lmloss": lambda x, w: lmloss.topk(x, w, k)}
    out = {"lmloss": lambda x, w: lt.linear_cross_entropy(x, w, y)}
    if mode == "fwd_bwd":
        def with_setting(name, value=False):
            """The same loss, one of lmloss.torch's settings set otherwise for the call."""
            def run(x, w):
                before = getattr(lt, name)
                setattr(lt, name, value)
                try:
                    return lt.linear_cross_entropy(x, w, y)
                finally:
                    setattr(lt, name, before)
            return run
        # The 16-bit dW summed in a float32 tensor of its own and rounded into a new one in
        # backward (lmloss.torch before the kept sum).
        out["lmloss-f32dw"] = with_setting("_KEEP_WEIGHT_SUM")
        # The last chunk's dW product added into the kept sum in the step, the sum rounded by its
        # own pass in backward (lmloss.torch before the deferred product).
        out["lmloss-nodefer"] = with_setting("_DEFER_WEIGHT_PRODUCT")
        # A bf16 dW's sum kept in float32 where lmloss.torch would keep it as its bf16 values
        # and 8-bit rests (3 bytes an entry against 4, the byte saved spent on workspace).
        out["lmloss-f32sum"] = with_setting("_KEEP_WEIGHT_RESTS", False)
        # The fused op alone, outside autograd: loss and gradients for an upstream gradient of 1,
        # a 16-bit dW kept as its float32 sum (what lmloss.torch's forward runs, before backward
        # rounds it).
        out["lmloss-op"] = lambda x, w: torch.ops.lmloss.loss_forward_backward(
            None, x, w, None, y, None, None, None, "mean", -100, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0,
            False, True, True, False, True)
    return out


def kernel_profile(run, top=8):
    """One run of the step under torch.profiler: its kernels' device time summed by name (the
    largest `top`, in ms) and their total, to set beside the step's CUDA-event time (the
    difference is time the device waited on the host or between streams)."""
    from torch.profiler import ProfilerActivity, profile
    run()
    torch.cuda.synchronize()
    flush_l2()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = run()
        torch.cuda.synchronize()
    del out
    by_name = {}
    for e in prof.events():
        if str(e.device_type).endswith("CUDA") and e.device_time_total > 0:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time_total / 1e3
    total = sum(by_name.values())
    return total, sorted(by_name.items(), key=lambda kv: -kv[1])[:top]


def print_kernels(heading, total, kernels):
    print(f"# {heading}: kernels {total:8.3f} ms in all")
    for name, k_ms in kernels:
        print(f"#   {k_ms:8.3f} ms  {name[:110]}")


def host_profile(run, steps=5, rounds=3):
    """The host's side of a step: its median ms over runs queued behind a sleep kernel long
    enough that the host never waits for the GPU (dispatch, allocation, launches), and in a
    synchronous run (the GPU idle before it) how long after a marker kernel the step's first
    kernel starts and how long the GPU idles between its kernels (gaps over 5 us, by CUPTI)."""
    from torch.profiler import ProfilerActivity, profile
    run()
    cycles = sleep_cycles(400)
    torch.cuda.synchronize()
    host = []
    for _ in range(rounds):
        torch.cuda._sleep(cycles)
        for _ in range(steps):
            t0 = time.perf_counter()
            run()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    flush_l2()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(1000)  # the marker: the first kernel in the trace
        out = run()
        torch.cuda.synchronize()
    del out
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
               if str(e.device_type).endswith("CUDA") and e.device_time_total > 0]
    return (statistics.median(host), *idle_time(kernels))


def idle_time(kernels, least_us=5.0):
    """(us from the end of the first kernel, the marker, to the start of the next; us of the gaps
    of more than least_us between the later ones, which may overlap on several streams), from
    (start, end) pairs in microseconds."""
    kernels = sorted(kernels)
    marker_end, step = kernels[0][1], kernels[1:]
    gaps, end = 0.0, step[0][0]
    for start, stop in step:
        if start > end + least_us:
            gaps += start - end
        end = max(end, stop)
    return step[0][0] - marker_end, gaps


def float64_reference(x, w, y, rows=1024):
    """Mean cross-entropy of x @ w.T against y, and its gradients for x and w, in float64, a chunk
    of rows at a time (the full float64 logits would not fit beside everything else)."""
    n = x.shape[0]
    wd = w.double()
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    dx = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    dw = torch.zeros(w.shape, dtype=torch.float64, device=x.device)
    for r0 in range(0, n, rows):
        xc = x[r0:r0 + rows].double()
        z = xc @ wd.T
        lse = torch.logsumexp(z, dim=1)
        yc = y[r0:r0 + rows]
        loss += (lse - z.gather(1, yc[:, None])[:, 0]).sum()
        g = torch.exp(z - lse[:, None])
        g[torch.arange(g.shape[0], device=g.device), yc] -= 1.0
        g /= n
        dx[r0:r0 + rows] = g @ wd
        dw += g.T @ xc
        del z, g
    return loss / n, dx, dw


def bf16_weight_gradients(x, w, y):
    """The array API's bf16 weight gradient (its float32 sum rounded once) and the C API's default
    for one (rounded after each token chunk), the latter through the extension's own call."""
    import lmloss
    from lmloss import _api
    once = lmloss.linear_cross_entropy(x, w, y, grad=True).grad_weight
    per_chunk = torch.empty_like(w)
    opts = _api.loss_options(reduction="mean", ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                             softcap=None, temperature=1.0, normalizer=None)
    device = x.device.index if x.device.type == "cuda" else -1
    _api.invoke_loss("forward_backward", device, hidden=x, weight=w, labels=y,
                     loss=torch.empty((), device=x.device), lse=torch.empty(x.shape[0], device=x.device),
                     grad_hidden=torch.empty_like(x), grad_weight=per_chunk, **opts)
    return once, per_chunk


def relative_error(out, ref):
    return (out.float() - ref.float()).norm().item() / max(ref.float().norm().item(), 1e-30)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="llama3-8b,gemma2-2b")
    ap.add_argument("--tokens", type=int, default=0, help="override N of every preset")
    ap.add_argument("--hidden", type=int, default=0, help="override H of every preset")
    ap.add_argument("--vocab", type=int, default=0, help="override V of every preset")
    ap.add_argument("--modes", default="fwd_bwd,dx_only,forward,distill64,topk64,topk2048")
    ap.add_argument("--methods", default="", help="comma list to keep (default: all that import)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the methods this many times, in reverse order every other round")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", action="store_true",
                    help="also each step's kernels by device time (torch.profiler, one run)")
    ap.add_argument("--accuracy", action="store_true",
                    help="fwd_bwd: errors of loss, dX and dW against a float64 reference")
    ap.add_argument("--launch-ahead", type=float, default=0.0, metavar="MS",
                    help="keep the GPU busy this long before each timed run (a sleep kernel), so "
                         "that the host's launches overlap it as in a training loop, where the "
                         "host runs ahead: the time is then the GPU's alone")
    ap.add_argument("--host", action="store_true",
                    help="also each step's host time with the GPU kept busy, and in a synchronous "
                         "run the GPU's wait for its first kernel and its idle gaps (CUPTI)")
    ap.add_argument("--clocks", action="store_true",
                    help="sample the SM clock (NVML) while each timed run is on the device")
    ap.add_argument("--data", choices=("random", "peaked"), default="random",
                    help="the inputs: random (flat softmaxes) or peaked like a trained head's")
    ap.add_argument("--lmloss-budget-gib", type=float, default=0.0, metavar="GIB",
                    help="lmloss's workspace budget (lmloss.set_workspace_budget); 0: its default")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    dev = torch.cuda.get_device_name()
    global _launch_ahead_cycles
    _launch_ahead_cycles = sleep_cycles(args.launch_ahead) if args.launch_ahead > 0 else 0
    global _clock_probe
    if args.clocks:
        _clock_probe = ClockProbe()
        if not _clock_probe.ok:
            print("# --clocks: NVML did not answer; no clocks", file=sys.stderr)
            _clock_probe = None
    if args.lmloss_budget_gib > 0:
        try:
            import lmloss
            lmloss.set_workspace_budget(int(args.lmloss_budget_gib * 2**30))
        except ImportError as e:
            print(f"# --lmloss-budget-gib: lmloss not available: {e}", file=sys.stderr)
    ahead = f", launched {args.launch_ahead:g} ms ahead" if args.launch_ahead > 0 else ""
    budget = f", lmloss budget {args.lmloss_budget_gib:g} GiB" if args.lmloss_budget_gib > 0 else ""
    print(f"# {dev}, torch {torch.__version__}, bf16, {args.data} data, median of {args.repeats}, "
          f"L2 flushed, CUDA events{ahead}{budget}")
    rows = []
    keep = set(filter(None, args.methods.split(",")))
    for preset in args.presets.split(","):
        n, h, v = PRESETS[preset]
        n, h, v = args.tokens or n, args.hidden or h, args.vocab or v
        print(f"# {preset}: N {n} H {h} V {v}", flush=True)
        x, w, y, ids, p = make_inputs(n, h, v, torch.bfloat16, data=args.data)
        for mode in args.modes.split(","):
            want_dx, want_dw, count = MODES[mode]
            if args.profile:
                print_kernels(f"{preset} {mode} floor", *kernel_profile(floor_fn(x, w, count)))
            ref_dx = None
            ref64 = float64_reference(x, w, y) if args.accuracy and mode == "fwd_bwd" else None
            fns = {**methods(mode, y, ids, p), **lmloss_methods(mode, y, ids, p)}
            names = [name for name in fns if not keep or name in keep]
            for round_index in range(args.rounds):
                first = round_index == 0  # errors and profiles are taken once
                for name in names if round_index % 2 == 0 else names[::-1]:
                    t0 = time.time()
                    floor_ms, _, floor_clocks = timed(floor_fn(x, w, count), args.repeats)
                    try:
                        no_autograd = name.endswith("-op")  # gradients from the op itself
                        run = step(fns[name], x, w, want_dx and not no_autograd, want_dw and not no_autograd)
                        ms, peak, clocks = timed(run, args.repeats)
                        err = None
                        err64 = None
                        if want_dx and not no_autograd and first:
                            loss, dx, dw = run()
                            if name == "naive":
                                ref_dx = dx.detach().clone()
                            elif ref_dx is not None:
                                err = relative_error(dx, ref_dx)
                            if ref64 is not None:
                                err64 = [relative_error(loss.detach().double(), ref64[0]),
                                         relative_error(dx, ref64[1]), relative_error(dw, ref64[2])]
                            del loss, dx, dw
                    except Exception as e:  # noqa: BLE001 - a peer failing is a row, not a crash
                        print(f"# {preset} {mode} {name}: failed: {e}", file=sys.stderr)
                        continue
                    row = dict(preset=preset, tokens=n, hidden=h, vocab=v, data=args.data, mode=mode,
                               lmloss_budget_gib=args.lmloss_budget_gib or None, method=name, ms=ms,
                               floor_ms=floor_ms, ratio=ms / floor_ms,
                               peak_gib=peak / 2**30, dx_rel_err_vs_naive=err, round=round_index,
                               wall_s=time.time() - t0)
                    if err64 is not None:
                        row.update(loss_rel_err_f64=err64[0], dx_rel_err_f64=err64[1],
                                   dw_rel_err_f64=err64[2])
                    clock_note = ""
                    if clocks and floor_clocks:
                        mhz, held, joules, watts = clocks
                        floor_mhz, floor_held, floor_joules, floor_watts = floor_clocks
                        row.update(sm_mhz=mhz, held_runs=held, floor_sm_mhz=floor_mhz,
                                   floor_held_runs=floor_held, joules=joules, watts=watts,
                                   floor_joules=floor_joules, floor_watts=floor_watts)
                        r = args.repeats
                        clock_note = (f"  clock {mhz:.0f} MHz, held {held}/{r}"
                                      f"{energy_note(joules, watts)}"
                                      f" (floor {floor_mhz:.0f} MHz, held {floor_held}/{r}"
                                      f"{energy_note(floor_joules, floor_watts)})")
                    rows.append(row)
                    print(f"{preset:10s} N {n:6d} {mode:9s} {name:14s} {ms:9.3f} ms  floor {floor_ms:8.3f}"
                          f"  x{ms / floor_ms:.3f}  peak {peak / 2**30:6.2f} GiB"
                          + (f"  round {round_index}" if args.rounds > 1 else "")
                          + (f"  dX err vs naive {err:.2e}" if err is not None else "")
                          + ("  vs f64: loss {:.1e} dX {:.1e} dW {:.1e}".format(*err64)
                             if err64 else "")
                          + clock_note, flush=True)
                    if args.host and first:
                        host_ms, first_us, gaps_us = host_profile(run)
                        print(f"#   {name}: host {host_ms:.3f} ms a step with the GPU busy; "
                              f"synchronous, its first kernel {first_us:.0f} us after the "
                              f"marker, idle gaps {gaps_us:.0f} us", flush=True)
                        rows[-1].update(host_ms=host_ms, first_kernel_us=first_us,
                                        idle_gaps_us=gaps_us)
                    if args.profile and first:
                        total, kernels = kernel_profile(run)
                        print_kernels(f"{name} (the step {ms:.3f} ms)", total, kernels)
                        rows[-1].update(kernel_ms=total, kernels=kernels)
                    torch.cuda.empty_cache()
            if args.rounds > 1:
                for name in names:
                    mine = [r for r in rows if r["preset"] == preset and r["mode"] == mode
                            and r["method"] == name and "ms" in r]
                    if mine:
                        ms = statistics.median(r["ms"] for r in mine)
                        ratio = statistics.median(r["ratio"] for r in mine)
                        print(f"# {preset} {mode} {name}: median of {len(mine)} rounds {ms:.3f} ms"
                              f" x{ratio:.3f}")
            if ref64 is not None and "lmloss" in lmloss_methods(mode, y, ids, p):
                # The weight gradient as the library accumulates it for a 16-bit head, in float32,
                # before the autograd layer rounds it to the parameter's bfloat16.
                dw32 = torch.ops.lmloss.loss_forward_backward(
                    None, x, w, None, y, None, None, None, "mean", -100, 0.0, 1.0, 0.0, 0.0, 0.0,
                    0.0, 1.0, False, False, True, False, False)[4]
                err = relative_error(dw32, ref64[2])
                del dw32
                once, per_chunk = bf16_weight_gradients(x, w, y)
                errs = dict(dw_f32_rel_err_f64=err, dw_bf16_once_rel_err_f64=relative_error(once, ref64[2]),
                            dw_bf16_per_chunk_rel_err_f64=relative_error(per_chunk, ref64[2]))
                del once, per_chunk
                rows.append(dict(preset=preset, tokens=n, hidden=h, vocab=v, data=args.data, mode=mode,
                                 method="lmloss", **errs))
                print(f"{preset:10s} N {n:6d} {mode:9s} lmloss: dW vs f64 accumulated in float32 "
                      f"{err:.1e}; bf16 rounded once {errs['dw_bf16_once_rel_err_f64']:.1e}, "
                      f"rounded per chunk {errs['dw_bf16_per_chunk_rel_err_f64']:.1e}", flush=True)
            del ref64
        del x, w, y, ids, p
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=dev, torch=torch.__version__, repeats=args.repeats,
                           launch_ahead_ms=args.launch_ahead, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
