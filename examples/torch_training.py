"""A small language model trained with lmloss.torch's loss at its head: the body's hidden states
and the head's weight go to the loss, so the [tokens x vocab] logits are never formed. Under
torch.autocast (bf16) the head's product takes autocast's dtype; the z-loss's log-sum-exp comes
back for logging. Runs on the GPU where there is one, else on the CPU, in a few seconds.

    python examples/torch_training.py
"""

import torch
import torch.nn.functional as F

import lmloss.torch as lt


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.body = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                                        torch.nn.Linear(hidden, hidden), torch.nn.LayerNorm(hidden))
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def hidden_states(self, tokens):
        return self.body(self.embed(tokens))


def main(steps: int = 60) -> float:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab, hidden, batch, seq = 1000, 64, 8, 32
    model = TinyLM(vocab, hidden).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # A fixed "corpus": each sequence counts up from a random start, so the next token is learnable.
    starts = torch.randint(0, vocab, (batch, 1), device=device)
    tokens = (starts + torch.arange(seq, device=device)) % vocab
    targets = F.pad(tokens[:, 1:], (0, 1), value=-100)  # position t predicts token t + 1
    first = last = None
    for step in range(steps):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss, lse = lt.linear_cross_entropy(model.hidden_states(tokens), model.lm_head.weight,
                                                targets, z_loss=1e-4, return_lse=True)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 20 == 0 or step == steps - 1:
            z = (lse[targets != -100] ** 2).mean().item()
            print(f"step {step:3d}  loss {loss.item():.4f}  mean lse^2 {z:.2f}")
        first = loss.item() if first is None else first
        last = loss.item()
    return last / first


if __name__ == "__main__":
    ratio = main()
    assert ratio < 0.5, f"the loss fell only to {ratio:.2f} of its first value"
