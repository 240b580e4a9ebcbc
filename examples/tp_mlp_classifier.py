"""A model that is not a GPT, built from gptpar's public layers: a tensor-parallel MLP classifier.

    python examples/tp_mlp_classifier.py            # trains on 2 gloo ranks and checks against tp=1

The hidden layer is column-parallel (each rank holds hidden/tp units), the output layer row-parallel
and split again column-wise over the classes, so the loss is the vocab-parallel cross-entropy: the
logits are never gathered. With the same seed the tp=2 run follows the tp=1 run step for step.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gptpar import ColumnParallelLinear, RowParallelLinear, vocab_parallel_cross_entropy  # noqa: E402
from gptpar.tensor_parallel import init_normal  # noqa: E402


class TPClassifier(nn.Module):
    def __init__(self, in_features, hidden, num_classes, group=None):
        super().__init__()
        self.group = group
        # Fan-in scaled normal init (init methods must be elementwise: they fill blocks of the full weight).
        self.up = ColumnParallelLinear(in_features, hidden, group=group,       # (b, hidden/tp)
                                       init_method=init_normal(in_features ** -0.5))
        self.down = RowParallelLinear(hidden, hidden, group=group,             # (b, hidden), all-reduced
                                      init_method=init_normal(hidden ** -0.5))
        self.head = ColumnParallelLinear(hidden, num_classes, group=group,     # (b, classes/tp)
                                         init_method=init_normal(hidden ** -0.5))

    def forward(self, x, labels):
        logits = self.head(F.gelu(self.down(F.gelu(self.up(x)))))
        return vocab_parallel_cross_entropy(logits, labels, group=self.group).mean()


def make_data(steps, batch=16, in_features=20, num_classes=8, seed=0):
    """A learnable toy problem: the class is the argmax of a fixed random projection of the input."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(in_features, num_classes, generator=g)
    xs = torch.randn(steps, batch, in_features, generator=g)
    return xs, (xs @ proj).argmax(-1)


def train(group=None, steps=40, seed=1234):
    """Train a few AdamW steps; returns the loss at every step (identical on every tp rank)."""
    torch.manual_seed(seed)
    model = TPClassifier(20, 64, 8, group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    xs, ys = make_data(steps)
    losses = []
    for x, y in zip(xs, ys):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _train_tp(tp):
    from gptpar import init_parallel

    return train(init_parallel(tp=tp).tp_group)


def main():
    from gptpar.testing import run_distributed

    serial = train()
    per_rank = run_distributed(_train_tp, 2, args=(2,))
    diff = max(abs(a - b) for a, b in zip(serial, per_rank[0]))
    print(f"tp=1 loss: {serial[0]:.4f} -> {serial[-1]:.4f} over {len(serial)} steps")
    print(f"tp=2 loss: {per_rank[0][0]:.4f} -> {per_rank[0][-1]:.4f}; max |tp=2 - tp=1| = {diff:.2e}")
    ok = diff < 1e-4 and per_rank[0] == per_rank[1]
    print("check:", "OK, tp=2 matches tp=1" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
