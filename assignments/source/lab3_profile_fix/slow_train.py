"""slow_train.py: trains a small CNN on synthetic images. It is correct, and much slower than it needs to be.

Lab 3 asks you to find what makes it slow. The comments [A] to [I] mark the candidate sites; some are real
bottlenecks, the others are harmless. (The grader regenerates this file to time it as the baseline.)
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

MEAN = torch.tensor([0.4914, 0.4822, 0.4465])
STD = torch.tensor([0.2470, 0.2435, 0.2616])


def make_data(n: int = 2048, seed: int = 0):
    """uint8 images (n, 32, 32, 3) and int64 labels (n,), as they would come from disk: learnable, 10 classes."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    colours = torch.rand(10, 3, generator=g) * 60 + 100
    stripes = (torch.arange(32)[None, :] * (labels[:, None] % 5 + 1) / 32 * 3.14159).sin()
    img = colours[labels][:, None, None, :] + 40 * stripes[:, None, :, None] * (labels[:, None, None, None] >= 5)
    img = img + torch.randn(n, 32, 32, 3, generator=g) * 90
    return img.clamp(0, 255).to(torch.uint8), labels


class Net(nn.Module):
    """A small CNN: a strided 3x3 convolution, pooling, a second convolution, pooling, one linear layer."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.c1 = nn.Conv2d(3, width, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc = nn.Linear(2 * width * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc(x.flatten(1))


def batches(images, labels, batch_size: int, seed: int):
    """One epoch of (normalized float images NCHW, labels) in a seeded random order; drops the last partial batch."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(labels), generator=g)  # [A]
    for s in range(0, len(order) - batch_size + 1, batch_size):
        idx = order[s:s + batch_size]
        xs = []
        for i in idx.tolist():  # [B]
            img = images[i].permute(2, 0, 1).float() / 255
            xs.append((img - MEAN[:, None, None]) / STD[:, None, None])
        yield torch.stack(xs), labels[idx]


def train(model, optimizer, images, labels, *, steps: int, batch_size: int = 64, seed: int = 0, device="cpu"):
    """Train for `steps` steps; returns {"losses": one float per step, "correct": right training predictions}."""
    torch.autograd.set_detect_anomaly(True)  # [C]
    model.train()  # [D]
    losses, correct, step, epoch = [], 0, 0, 0
    try:
        while step < steps:
            for x, y in batches(images, labels, batch_size, seed + epoch):  # [E]
                x, y = x.to(device), y.to(device)  # [F]
                out = model(x)
                loss = F.cross_entropy(out, y)  # [G]
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())  # [H]
                for p, t in zip(out.argmax(1), y, strict=True):  # [I]
                    correct += int(p == t)
                step += 1
                if step == steps:
                    break
            epoch += 1
    finally:
        torch.autograd.set_detect_anomaly(False)
    return {"losses": losses, "correct": correct}


if __name__ == "__main__":
    torch.manual_seed(0)
    images, labels = make_data()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    result = train(model, opt, images, labels, steps=60)
    print(f"final loss {result['losses'][-1]:.3f}, training accuracy {result['correct'] / (60 * 64):.1%}")
