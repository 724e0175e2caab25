"""The scripts in bench/ that run without a GPU: the bf16 rounding emulations behind the figures in
docs/contract.md, checked on small problems and against the CPU library; the GPU scripts parsed,
so that a syntax error shows here rather than on a borrowed GPU."""

import ast
import math
import pathlib
import sys

import numpy as np
import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import dw_rounding  # noqa: E402


def test_bf16_rounds_to_nearest_even():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -7)
    values = np.array([one + ulp / 2, one + 3 * ulp / 2, one + ulp / 4, -(one + 3 * ulp / 4)], np.float32)
    np.testing.assert_array_equal(dw_rounding.bf16(values),
                                  np.array([one, one + 2 * ulp, one, -(one + ulp)], np.float32))


def test_emulation_orders_the_roundings():
    """Rounded once is as far from float64 as naive bf16; rounded after each of 8 chunks, further;
    the unrounded sum (its only error the products' bf16 inputs) well closer than either."""
    e = dw_rounding.emulate(2048, 1000, 16, 256)
    assert e["chunks"] == 8
    assert abs(e["once"] - e["naive"]) <= 0.1 * e["naive"]
    assert e["per_chunk"] >= 1.5 * e["once"]
    assert e["per_chunk_x2"] >= e["per_chunk"] * 0.95
    assert e["f32_sum"] <= 0.25 * e["once"]


@pytest.mark.parametrize("bits", [8, 4])
def test_sum_split_into_bf16_and_a_rest_rebuilds_it(bits):
    """A value split into its bf16 value and a rest of `bits` bits comes back within half the rest's
    unit (a bf16 ulp / (2^bits - 2)), the rest within its bits, at any scale, at zero and among the
    subnormals; halfway values (ties of the bf16 rounding) take the rest's extremes."""
    rng = np.random.default_rng(3)
    values = rng.standard_normal(20000) * 10.0 ** rng.integers(-30, 20, 20000)
    ties = [1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8]  # rounded to even: down, then up
    values = np.concatenate([values, [0.0, 2.0 ** -130, -(2.0 ** -126) * 1.3], ties])
    values = values.astype(np.float32).astype(np.float64)
    high, rest = dw_rounding.split_sum(values, bits)
    assert np.all(np.abs(rest) <= 2 ** (bits - 1) - 1)
    assert list(rest[-2:]) == [2 ** (bits - 1) - 1, -(2 ** (bits - 1) - 1)]
    error = np.abs(dw_rounding.joined_sum(high, rest, bits) - values)
    assert np.all(error <= 0.5 * dw_rounding.rest_unit(high, bits) * (1 + 1e-9))
    assert np.all(error[-2:] == 0)


def test_emulation_of_a_sum_kept_with_a_rest_rounds_as_once():
    """A sum kept as bf16 and an 8-bit rest, split again after each of 8 chunks, ends as close to
    float64 as the f32 sum rounded once, and the kept sum itself nearly as close as the unrounded
    one; with a 4-bit rest the kept sum drifts further but its rounding hardly; rounded to bf16
    alone after each chunk (no rest), far from it."""
    e = dw_rounding.emulate(2048, 1000, 16, 256, rest_bits=(8, 4))
    assert abs(e["rest"][8] - e["once"]) <= 0.01 * e["once"], e
    assert abs(e["rest"][4] - e["once"]) <= 0.05 * e["once"], e
    assert e["rest_sum"][8] <= 1.01 * e["f32_sum"] and e["rest_sum"][4] >= 1.2 * e["f32_sum"], e
    assert e["per_chunk"] >= 1.5 * e["rest"][4], e


def test_emulation_matches_the_library_called_per_chunk():
    """The CPU library, called once a chunk adding into a bf16 dW (each call rounds once), drifts as
    the emulation's per-chunk rounding says (its gradient is not rounded to bf16 before the
    product, the emulation's is: a few percent apart)."""
    pytest.importorskip("torch", reason="PyTorch is not installed")
    e = dw_rounding.emulate(2048, 1000, 16, 256)
    err = dw_rounding.relative_error(dw_rounding.library_per_chunk(2048, 1000, 16, 256), e["exact"])
    assert abs(err - e["per_chunk"]) <= 0.1 * e["per_chunk"], f"{err:.3g} against {e['per_chunk']:.3g}"


def test_f32_sum_forms_emulation_orders_the_roundings():
    """A dW summed in f32 from bf16 gradients, on peaked inputs: each of the exponential form's two
    roundings alone leaves ~1e-3, both together more than either, an f16 gradient well under; on
    the flat random inputs every form is far closer."""
    pytest.importorskip("torch", reason="PyTorch is not installed")
    peaked = dw_rounding.emulate_forms(256, 4000, 1024, "peaked")
    flat = dw_rounding.emulate_forms(256, 4000, 1024, "random")
    assert peaked["both"] > 1.1 * max(peaked["exp(s - s_y)"], peaked["f X"]), peaked
    assert 5e-4 < peaked["gradient form"] < 3e-3, peaked
    assert peaked["f16 gradient"] < 0.3 * peaked["gradient form"], peaked
    assert flat["both"] < 0.3 * peaked["both"], (flat, peaked)


def test_forms_emulation_with_the_large_entries_exact():
    """The entries of probability (or |gradient|) 1/16 or more kept exact, the rest rounded: on
    peaked inputs both forms come well under the all-rounded error, a smaller threshold closer
    still, and no row has more such entries than its probabilities allow (1/T, plus the label)."""
    pytest.importorskip("torch", reason="PyTorch is not installed")
    e = dw_rounding.emulate_forms(256, 4000, 1024, "peaked", exact_above=(1 / 4, 1 / 16))
    for form in ("gradient form", "both"):
        assert e[f"{form}, 0.0625"] < e[f"{form}, 0.25"] < 0.5 * e[form], e
    assert e["both, 0.0625"] < 0.2 * e["both"], e
    for t, (mean, largest) in e["entries"].items():
        assert 1 <= mean <= largest <= 1 / t + 1, e["entries"]


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_bench_script_parses(script):
    ast.parse((BENCH / script).read_text(), filename=script)


def test_peers_clocks_count_only_the_timed_run(monkeypatch):
    """--clocks with --launch-ahead: the SM clock sampled while the sleep kernel queued ahead of a
    run is on the device is not that run's clock. A simulated device, a tick per poll: the sleep
    kernel (900 MHz) until tick 6, where the start event is reached, then the run (1500 MHz, held
    back at tick 7) until tick 9, where the stop event is: most samples are the sleep kernel's."""
    torch = pytest.importorskip("torch")
    import peers

    device = {"tick": 0, "events": 0}

    class Event:
        def __init__(self, enable_timing):
            self.reached_at = 6 if device["events"] % 2 == 0 else 9  # start, then stop
            device["events"] += 1

        def record(self):
            pass

        def query(self):
            return device["tick"] >= self.reached_at

        def elapsed_time(self, other):
            return 1.0

    class Probe:
        def sample(self):
            t = device["tick"]
            return (900, False) if t < 6 else (1500, t == 7)

        def energy_mj(self):  # a driver that counts no energy
            return None

    def next_run():
        device["tick"] = 0

    def tick(seconds):
        device["tick"] += 1

    for name, value in {"Event": Event, "synchronize": lambda: None, "memory_allocated": lambda: 0,
                        "reset_peak_memory_stats": lambda: None, "max_memory_allocated": lambda: 0,
                        "_sleep": lambda cycles: None}.items():
        monkeypatch.setattr(torch.cuda, name, value, raising=False)
    monkeypatch.setattr(peers, "flush_l2", next_run)
    monkeypatch.setattr(peers, "_clock_probe", Probe())
    monkeypatch.setattr(peers, "_launch_ahead_cycles", 1000)
    monkeypatch.setattr(peers.time, "sleep", tick)
    ms, peak, clocks = peers.timed(lambda: None, repeats=3)
    assert (ms, peak) == (1.0, 0)
    assert clocks == (1500, 3, None, None)


def test_peers_energy_counts_back_to_back_runs(monkeypatch):
    """--clocks' energy: the driver's counter over back-to-back runs of at least STEADY_S (each
    run here 40 ms and 30 J on a simulated device, the gradients reset before each), divided by
    their count; the power is its rate over the host's time."""
    torch = pytest.importorskip("torch")
    import peers

    device = {"mj": 5000, "s": 100.0, "runs": 0, "resets": 0}

    def run():
        device["mj"] += 30_000
        device["s"] += 0.040
        device["runs"] += 1

    run.reset = lambda: device.__setitem__("resets", device["resets"] + 1)

    class Probe:
        def energy_mj(self):
            return device["mj"]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(peers, "_clock_probe", Probe())
    monkeypatch.setattr(peers.time, "perf_counter", lambda: device["s"])
    joules, watts = peers.steady_energy(run, run_ms=40.0)
    assert device["runs"] == device["resets"] == 50  # 2 s of 40 ms runs
    assert joules == pytest.approx(30.0) and watts == pytest.approx(750.0)


@pytest.mark.parametrize("data", ["random", "peaked"])
def test_peers_inputs_shape_the_softmax_as_named(data):
    """peers.py --data: "random" gives flat softmaxes (a row's largest probability ~2%, the loss
    above log V), "peaked" a trained head's (most of a row on a few tokens, the label among them:
    the loss a few nats); the distillation targets are the same either way."""
    torch = pytest.importorskip("torch")
    import peers

    n, h, v = 256, 2048, 8000
    x, w, y, ids, p = peers.make_inputs(n, h, v, torch.bfloat16, data=data, device="cpu")
    assert x.shape == (n, h) and w.shape == (v, h) and x.dtype == w.dtype == torch.bfloat16
    assert y.shape == (n,) and int(y.min()) >= 0 and int(y.max()) < v
    z = x.float() @ w.float().T
    loss = (torch.logsumexp(z, 1) - z.gather(1, y[:, None]).squeeze(1)).mean().item()
    top = torch.softmax(z, 1).amax(1).mean().item()
    if data == "random":
        assert loss > math.log(v) and top < 0.05, (loss, top)
    else:
        assert loss < 0.5 * math.log(v) and top > 0.3, (loss, top)
    assert ids.shape == p.shape == (n, 64)
    torch.testing.assert_close(p.sum(1), torch.ones(n))


def test_peers_inputs_refuse_an_unknown_kind():
    torch = pytest.importorskip("torch")
    import peers

    with pytest.raises(ValueError, match="random or peaked"):
        peers.make_inputs(4, 8, 16, torch.bfloat16, data="trained", device="cpu")


def test_peers_idle_time_counts_only_the_gaps_no_stream_covers():
    # A marker ending at 10 us, the step's first kernel at 510; a kernel on a second stream
    # (600-900) covers the first stream's pause (700-800); gaps of 3 us are not counted, 50 us is.
    pytest.importorskip("torch")
    import peers
    kernels = [(900, 950), (0, 10), (510, 700), (600, 900), (800, 850), (953, 960), (1010, 1100)]
    first_us, gaps_us = peers.idle_time(kernels)
    assert first_us == 500
    assert gaps_us == 50
