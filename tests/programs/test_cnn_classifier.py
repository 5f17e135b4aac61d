"""A small CNN image classifier, trained the way a typical PyTorch script trains one.

Synthetic 3x16x16 images whose class is the brighter quadrant; a conv net with BatchNorm;
``DataLoader(num_workers=2, pin_memory=True)`` feeding ``.to(device, non_blocking=True)``; SGD
with momentum and weight decay, a ``OneCycleLR`` schedule, ``clip_grad_norm_``; the loss logged
with ``.item()`` every few steps; an eval loop per epoch under ``model.eval()`` and
``torch.inference_mode()``; a checkpoint every epoch, resumed the way one restores a large
model: build it on the ``meta`` device and ``load_state_dict(..., assign=True)`` from a
``map_location`` load. No dropout and no random augmentation: nothing random happens on the
device.
"""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from program_harness import assert_histories_match, assert_resumes_identically, run_on_cpu_and_tpu

BATCH = 32
TRAIN_IMAGES = 8 * BATCH  # 8 steps per epoch
LOG_EVERY = 4


class Net(nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(16, classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def make_images(n: int, generator: torch.Generator):
    """``n`` noisy images; the label is the quadrant made brighter."""
    labels = torch.randint(0, 4, (n,), generator=generator)
    images = 0.5 * torch.randn(n, 3, 16, 16, generator=generator)
    for i, label in enumerate(labels.tolist()):
        r, c = divmod(label, 2)
        images[i, :, 8 * r : 8 * r + 8, 8 * c : 8 * c + 8] += 1.0
    return images, labels


def evaluate(model, loader, device):
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    with torch.inference_mode():  # as torchvision's reference scripts evaluate
        for images, labels in loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            logits = model(images)
            total_loss += F.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(1) == labels).sum().item()
            count += labels.numel()
    model.train()
    return total_loss / count, correct


def run(device, steps, workdir, resume_from=None):
    torch.manual_seed(0)
    data_gen = torch.Generator().manual_seed(1)
    train_set = TensorDataset(*make_images(TRAIN_IMAGES, data_gen))
    val_set = TensorDataset(*make_images(64, data_gen))
    # The sampler owns the shuffling generator (saved in the checkpoint). DataLoader(generator=)
    # would also draw the workers' base seed from it, once per fresh iterator, so a resumed run
    # would see a different order than the uninterrupted one.
    shuffle_gen = torch.Generator().manual_seed(2)
    train_loader = DataLoader(
        train_set, batch_size=BATCH, sampler=RandomSampler(train_set, generator=shuffle_gen), drop_last=True,
        num_workers=2, pin_memory=True, persistent_workers=True,
    )
    val_loader = DataLoader(val_set, batch_size=BATCH, pin_memory=True)  # same shapes as training
    steps_per_epoch = len(train_loader)

    if resume_from is None:
        model = Net().to(device)
    else:  # restore the way large models are restored: no initialisation, tensors assigned
        checkpoint = torch.load(resume_from, map_location=device)
        with torch.device("meta"):
            model = Net()
        model.load_state_dict(checkpoint["model"], assign=True)
        assert all(p.device.type == torch.device(device).type for p in model.parameters())
        assert all(b.device.type == torch.device(device).type for b in model.buffers())

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.4, total_steps=steps)
    start = 0
    if resume_from is not None:
        opt.load_state_dict(checkpoint["optimizer"])
        sched.load_state_dict(checkpoint["scheduler"])
        shuffle_gen.set_state(checkpoint["shuffle_rng"].cpu())  # map_location moved it too
        start = checkpoint["step"]

    history = {name: {} for name in ("loss", "grad_norm", "lr", "weight", "bn_mean", "eval_loss", "eval_correct")}
    step = start
    while step < steps:
        for images, labels in train_loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = F.cross_entropy(model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=2.0)
            opt.step()
            history["lr"][step] = sched.get_last_lr()[0]
            sched.step()

            history["loss"][step] = loss.detach()
            history["grad_norm"][step] = grad_norm
            history["weight"][step] = model.classifier.weight[0].detach().clone()
            history["bn_mean"][step] = model.features[1].running_mean.clone()
            if step % LOG_EVERY == 0:
                print(f"step {step:3d}  loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.4f}")
            step += 1
            if step == steps:
                break
        if step % steps_per_epoch == 0:
            history["eval_loss"][step - 1], history["eval_correct"][step - 1] = evaluate(model, val_loader, device)
            torch.save(
                {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "shuffle_rng": shuffle_gen.get_state(), "step": step},
                os.path.join(workdir, f"ckpt_{step}.pt"),
            )
    return history


def check(cpu, tpu, steps):
    assert_histories_match(cpu, tpu)
    assert tpu["loss"][steps - 1] < 0.6 * tpu["loss"][0], "the classifier did not learn"
    assert tpu["eval_correct"][steps - 1] > 40  # of 64; chance is 16


def test_cnn_classifier_matches_cpu_and_resumes(tmp_path):
    steps = 16  # two epochs
    cpu, tpu = run_on_cpu_and_tpu(run, steps, tmp_path)
    check(cpu, tpu, steps)
    # From the checkpoint the tpu run wrote after epoch 1, into a meta-device model with
    # assign=True: the same numbers as the uninterrupted run.
    assert_resumes_identically(run, "tpu", steps, tmp_path, tpu, from_step=8)


@pytest.mark.slow
def test_cnn_classifier_fused_eager_matches_cpu(tmp_path):
    steps = 16
    check(*run_on_cpu_and_tpu(run, steps, tmp_path, tpu_eager_mode="DEFER_AND_FUSE"), steps)
