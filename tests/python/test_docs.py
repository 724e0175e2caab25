"""The Python examples of README.md and docs/python.md, run as written on the CPU: each block with
the names it leaves to the reader (a model, its tokens and labels, an optimizer, arrays) bound to
a small stand-in, so that a renamed function or argument shows here before a reader finds it."""

import pathlib
import re
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/python.md"]
VOCAB, HIDDEN, BATCH, TIME = 50, 16, 2, 5


def python_blocks():
    blocks = []
    for name in DOCS:
        text = (ROOT / name).read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            line = text.count("\n", 0, m.start()) + 2
            blocks.append(pytest.param(m.group(1), id=f"{name}:{line}"))
    return blocks


class TinyCausalLM(torch.nn.Module):
    """A body, a head and a Hugging Face style decoder: what the examples call on `model`."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.mix = torch.nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.config = types.SimpleNamespace()  # no final_logit_softcapping, as most models

    def body(self, tokens):
        return torch.tanh(self.mix(self.embed(tokens)))

    def get_decoder(self):
        def decoder(input_ids, attention_mask=None):
            return types.SimpleNamespace(last_hidden_state=self.body(input_ids))
        return decoder


def torch_names():
    import lmloss.torch as lt  # a block that continues the one before it takes it from there

    torch.manual_seed(0)
    model = TinyCausalLM()
    tokens = torch.randint(0, VOCAB, (BATCH, TIME))
    labels = torch.randint(0, VOCAB, (BATCH, TIME))
    labels[0, -1] = -100
    return dict(model=model, tokens=tokens, labels=labels, input_ids=tokens,
                attention_mask=torch.ones_like(tokens), torch=torch, lt=lt,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def array_names():
    rng = np.random.default_rng(0)
    n = BATCH * TIME
    return dict(hidden=rng.standard_normal((n, HIDDEN), dtype=np.float32),
                weight=rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32),
                labels=rng.integers(0, VOCAB, n),
                teacher_hidden=rng.standard_normal((n, HIDDEN), dtype=np.float32),
                teacher_weight=rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32))


@pytest.mark.parametrize("code", python_blocks())
def test_python_example_runs(code):
    names = array_names() if "import numpy" in code else torch_names()
    head = names.get("model")
    before = head.lm_head.weight.detach().clone() if head is not None else None
    exec(compile(code, "<example>", "exec"), names)
    if "LossHead" in names:  # the sharding example's module, called as its text says
        names["loss"] = names["LossHead"](head.lm_head)(head.body(names["tokens"]), names["labels"])
    loss = names["r"].loss if "r" in names else names.get("loss")  # NumPy's result, or a loss
    if loss is not None:
        assert np.isfinite(float(torch.as_tensor(loss).detach()))
    if "backward()" in code:
        assert head.lm_head.weight.grad is not None and head.mix.weight.grad is not None
    if "optimizer.step()" in code:
        assert not torch.equal(head.lm_head.weight.detach(), before), "the step left the head"


def test_every_python_example_is_found():
    """The pattern finds the blocks: the two training examples, NumPy's, the sharded module's
    and the Hugging Face one at least. Without this, a changed fence would test nothing."""
    assert len(python_blocks()) >= 5
