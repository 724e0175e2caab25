"""Bad arguments: the exception's type, the argument named at the start of its message, and every
input (the logits given for an in-place gradient included) left as it was."""

import numpy as np
import pytest

import lmloss
from numpy_reference import make_labels, make_linear, make_logits, make_teacher

N, H, V, K = 6, 8, 17, 3


def inputs():
    rng = np.random.default_rng(0)
    x, w, b = make_linear(rng, N, H, V, bias=True)
    ids, p = make_teacher(rng, N, V, K)
    return dict(z=make_logits(rng, N, V), x=x, w=w, b=b, y=make_labels(rng, N, V), ids=ids, p=p,
                mask=np.ones(N, dtype=bool))


def _bad_label(a):
    y = a["y"].copy()
    y[2] = V
    return y


def _negative_label(a):
    y = a["y"].copy()
    y[1] = -1
    return y


def _bad_teacher_id(a):
    ids = a["ids"].copy()
    ids[3, 1] = V + 5
    return ids


def _read_only(z):
    z = z.copy()
    z.flags.writeable = False
    return z


CE = lmloss.cross_entropy
LCE = lmloss.linear_cross_entropy
KD = lmloss.linear_distill

# (id, call(inputs), exception, argument named)
CASES = [
    ("ce_labels_float", lambda a: CE(a["z"], a["y"].astype(np.float32)), TypeError, "labels"),
    ("ce_logits_int", lambda a: CE(a["z"].astype(np.int32), a["y"]), TypeError, "logits"),
    ("ce_labels_int16", lambda a: CE(a["z"], a["y"].astype(np.int16)), TypeError, "labels"),
    ("ce_logits_list", lambda a: CE(a["z"].tolist(), a["y"]), TypeError, "logits"),
    ("ce_logits_scalar", lambda a: CE(np.float64(1.0), a["y"]), ValueError, "logits"),
    ("ce_labels_shape", lambda a: CE(a["z"], a["y"][:-1]), ValueError, "labels"),
    ("ce_labels_2d", lambda a: CE(a["z"], a["y"][:, None]), ValueError, "labels"),
    ("ce_label_out_of_range", lambda a: CE(a["z"], _bad_label(a), grad=True), ValueError, "labels"),
    ("ce_label_out_of_range_inplace",
     lambda a: CE(a["z"], _bad_label(a), inplace_grad=True), ValueError, "labels"),
    ("ce_label_negative", lambda a: CE(a["z"], _negative_label(a)), ValueError, "labels"),
    ("ce_reduction", lambda a: CE(a["z"], a["y"], reduction="avg"), ValueError, "reduction"),
    ("ce_reduction_type", lambda a: CE(a["z"], a["y"], reduction=1), TypeError, "reduction"),
    ("ce_temperature_zero", lambda a: CE(a["z"], a["y"], temperature=0.0, inplace_grad=True),
     ValueError, "temperature"),
    ("ce_temperature_nan", lambda a: CE(a["z"], a["y"], temperature=float("nan")), ValueError,
     "temperature"),
    ("ce_softcap_negative", lambda a: CE(a["z"], a["y"], softcap=-1.0), ValueError, "softcap"),
    ("ce_softcap_zero", lambda a: CE(a["z"], a["y"], softcap=0), ValueError, "softcap"),
    ("ce_label_smoothing", lambda a: CE(a["z"], a["y"], label_smoothing=1.5, inplace_grad=True),
     ValueError, "label_smoothing"),
    ("ce_z_loss", lambda a: CE(a["z"], a["y"], z_loss=-1.0), ValueError, "z_loss"),
    ("ce_normalizer", lambda a: CE(a["z"], a["y"], normalizer=0.0), ValueError, "normalizer"),
    ("ce_ignore_index_type", lambda a: CE(a["z"], a["y"], ignore_index="x"), TypeError,
     "ignore_index"),
    ("ce_temperature_type", lambda a: CE(a["z"], a["y"], temperature="hot"), TypeError,
     "temperature"),
    ("ce_inplace_read_only", lambda a: CE(_read_only(a["z"]), a["y"], inplace_grad=True),
     ValueError, "logits"),
    ("ce_inplace_not_foldable",
     lambda a: CE(np.stack([a["z"]] * 2, axis=1).swapaxes(0, 1), np.stack([a["y"]] * 2),
                  inplace_grad=True), ValueError, "logits"),
    ("lce_weight_hidden_size", lambda a: LCE(a["x"], a["w"][:, :-1], a["y"], grad=True),
     ValueError, "weight"),
    ("lce_weight_1d", lambda a: LCE(a["x"], a["w"][0], a["y"]), ValueError, "weight"),
    ("lce_weight_dtype", lambda a: LCE(a["x"], a["w"].astype(np.float32), a["y"], grad=True),
     TypeError, "weight"),
    ("lce_bias_shape", lambda a: LCE(a["x"], a["w"], a["y"], bias=a["b"][:-1], grad=True),
     ValueError, "bias"),
    ("lce_bias_dtype", lambda a: LCE(a["x"], a["w"], a["y"], bias=a["b"].astype(np.float32)),
     TypeError, "bias"),
    ("lce_hidden_list", lambda a: LCE(a["x"].tolist(), a["w"], a["y"]), TypeError, "hidden"),
    ("lce_labels_shape", lambda a: LCE(a["x"], a["w"], a["y"][:3]), ValueError, "labels"),
    ("lce_label_out_of_range", lambda a: LCE(a["x"], a["w"], _bad_label(a), grad=True),
     ValueError, "labels"),
    ("kd_teacher_id_out_of_range", lambda a: KD(a["x"], a["w"], _bad_teacher_id(a), a["p"], grad=True),
     ValueError, "teacher_ids"),
    ("kd_teacher_ids_float", lambda a: KD(a["x"], a["w"], a["ids"].astype(np.float64), a["p"]),
     TypeError, "teacher_ids"),
    ("kd_teacher_probs_shape", lambda a: KD(a["x"], a["w"], a["ids"], a["p"][:, :-1]),
     ValueError, "teacher_probs"),
    ("kd_teacher_probs_rows", lambda a: KD(a["x"], a["w"], a["ids"], a["p"][:-1]),
     ValueError, "teacher_probs"),
    ("kd_teacher_probs_dtype", lambda a: KD(a["x"], a["w"], a["ids"], a["p"].astype(np.float16)),
     TypeError, "teacher_probs"),
    ("kd_token_mask_dtype", lambda a: KD(a["x"], a["w"], a["ids"], a["p"],
                                         token_mask=a["mask"].astype(np.float32)),
     TypeError, "token_mask"),
    ("kd_token_mask_shape", lambda a: KD(a["x"], a["w"], a["ids"], a["p"], token_mask=a["mask"][1:]),
     ValueError, "token_mask"),
    ("kd_ce_without_labels", lambda a: KD(a["x"], a["w"], a["ids"], a["p"], ce_weight=0.5),
     ValueError, "labels"),
    ("kd_weight_type", lambda a: KD(a["x"], a["w"], a["ids"], a["p"], kd_weight="1"), TypeError,
     "kd_weight"),
    ("topk_k_zero", lambda a: lmloss.topk(a["x"], a["w"], 0), ValueError, "k"),
    ("topk_k_too_large", lambda a: lmloss.topk(a["x"], a["w"], V + 1), ValueError, "k"),
    ("topk_k_float", lambda a: lmloss.topk(a["x"], a["w"], 1.5), TypeError, "k"),
    ("topk_temperature", lambda a: lmloss.topk(a["x"], a["w"], 2, temperature=-1.0), ValueError,
     "temperature"),
    ("topk_weight_dtype", lambda a: lmloss.topk(a["x"], a["w"].astype(np.float32), 2), TypeError,
     "weight"),
    ("topk_logits_k", lambda a: lmloss.topk_logits(a["z"], V + 1), ValueError, "k"),
    ("topk_logits_softcap", lambda a: lmloss.topk_logits(a["z"], 2, softcap=-3.0), ValueError,
     "softcap"),
    ("workspace_budget", lambda a: lmloss.set_workspace_budget(0), ValueError, "nbytes"),
    ("workspace_budget_huge", lambda a: lmloss.set_workspace_budget(1 << 70), ValueError, "nbytes"),
    ("num_threads", lambda a: lmloss.set_num_threads(-2), ValueError, "num_threads"),
    ("num_threads_huge", lambda a: lmloss.set_num_threads(1 << 40), ValueError, "num_threads"),
    ("ce_ignore_index_huge", lambda a: CE(a["z"], a["y"], ignore_index=1 << 63), ValueError,
     "ignore_index"),
    ("lce_hidden_big_endian", lambda a: LCE(a["x"].astype(">f8"), a["w"], a["y"]), TypeError,
     "hidden"),
    ("lce_labels_strings", lambda a: LCE(a["x"], a["w"], a["y"].astype(str)), TypeError, "labels"),
    ("lce_grad_weight_dtype_bf16_numpy",
     lambda a: LCE(a["x"], a["w"], a["y"], grad=True, grad_weight_dtype="bfloat16"), TypeError,
     "grad_weight_dtype"),
    ("product_tuning", lambda a: lmloss.set_product_tuning(1), TypeError, "enabled"),
]


@pytest.mark.parametrize("call,exception,name", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument(call, exception, name):
    a = inputs()
    before = {k: v.copy() for k, v in a.items()}
    with pytest.raises(exception) as info:
        call(a)
    message = str(info.value)
    assert message.startswith(name + ":"), f"message does not start with '{name}:': {message}"
    for k, v in a.items():
        np.testing.assert_array_equal(v, before[k], err_msg=f"input {k} changed")


def test_inplace_logits_unchanged_on_error():
    """The in-place gradient's buffer is the caller's logits: a failed call must not touch it."""
    a = inputs()
    z = a["z"]
    before = z.copy()
    with pytest.raises(ValueError):
        CE(z, _bad_label(a), inplace_grad=True)
    np.testing.assert_array_equal(z, before)
    with pytest.raises(ValueError):
        CE(z, a["y"], inplace_grad=True, label_smoothing=2.0)
    np.testing.assert_array_equal(z, before)
    CE(z, a["y"], inplace_grad=True)
    assert not np.array_equal(z, before)  # the same call, valid, does write


def test_settings_survive_errors():
    a = inputs()
    with pytest.raises(ValueError):
        CE(a["z"], _bad_label(a))
    assert np.isfinite(CE(a["z"], a["y"]).loss)


@pytest.mark.parametrize("keyword", ["temperature", "label_smoothing", "ignore_index"])
def test_booleans_are_not_numbers_here(keyword):
    a = inputs()
    with pytest.raises(TypeError, match=f"^{keyword}:"):
        lmloss.cross_entropy(a["z"], a["y"], **{keyword: True})


def test_teacher_of_other_leading_dimensions_is_refused():
    a = inputs()
    with pytest.raises(ValueError, match="^teacher_ids:"):
        lmloss.linear_distill(a["x"].reshape(2, 3, H), a["w"], a["ids"].reshape(3, 2, K),
                              a["p"].reshape(2, 3, K))


@pytest.mark.parametrize("status,message,exception", [
    ("invalid_argument", "head.logits: rank must be 0, 1 or 2", ValueError),
    ("unsupported", "head.logits: dtype f16 not allowed", TypeError),
    ("id_out_of_range", "targets.labels: out of range", ValueError),
    ("unsupported", "head.hidden: not in this build", NotImplementedError),
    ("out_of_memory", "host memory allocation failed", MemoryError),
    ("backend", "CUDA error", RuntimeError),
])
def test_library_statuses_become_python_exceptions(status, message, exception):
    # Some statuses come only from a GPU (an id found out of range on the device) or from a
    # build without it: translated here directly. The argument is named as the caller wrote it.
    e = lmloss._api._translate(lmloss._lmloss.Error(status, message))
    assert type(e) is exception
    assert str(e) == message.replace("head.", "").replace("targets.", "")
