"""A variational autoencoder on tiny binary images, trained like the PyTorch VAE example.

MLP encoder and decoder, the reparameterisation trick, BCE reconstruction plus KL; Adam with
an ``ExponentialLR`` stepped per epoch; ``clip_grad_norm_``; ``DataLoader(num_workers=2,
pin_memory=True)``; the loss logged with ``.item()``; an eval loop (test ELBO) and samples from
the prior under ``torch.no_grad()``; a checkpoint resumed into a fresh model.

The reparameterisation noise is drawn on the CPU from a seeded generator and moved to the
device: ``torch.randn_like`` on ``tpu`` draws different numbers than on the CPU (the same seed
gives the same numbers on the same device, but not across devices), and the comparison needs
the same noise on both sides.
"""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from program_harness import assert_histories_match, assert_resumes_identically, run_on_cpu_and_tpu

SIDE, LATENT, BATCH = 8, 4, 32
LOG_EVERY = 4


class VAE(nn.Module):
    def __init__(self, d_in=SIDE * SIDE, hidden=64, latent=LATENT):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc_mu = nn.Linear(hidden, latent)
        self.fc_logvar = nn.Linear(hidden, latent)
        self.fc3 = nn.Linear(latent, hidden)
        self.fc4 = nn.Linear(hidden, d_in)

    def encode(self, x):
        h = F.relu(self.fc1(x))
        return self.fc_mu(h), self.fc_logvar(h)

    def decode(self, z):
        return self.fc4(F.relu(self.fc3(z)))  # logits

    def forward(self, x, eps):
        mu, logvar = self.encode(x.flatten(1))
        z = mu + eps * torch.exp(0.5 * logvar)  # eps ~ N(0, 1), drawn by the caller on the CPU
        return self.decode(z), mu, logvar


def loss_function(recon_logits, x, mu, logvar):
    bce = F.binary_cross_entropy_with_logits(recon_logits, x.flatten(1), reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return (bce + kld) / x.size(0)


def bars(n: int, generator: torch.Generator) -> torch.Tensor:
    """Binary images of one to three random horizontal or vertical bars."""
    images = torch.zeros(n, 1, SIDE, SIDE)
    for i in range(n):
        rows = torch.randperm(SIDE, generator=generator)[: int(torch.randint(1, 4, (1,), generator=generator))]
        if torch.rand(1, generator=generator) < 0.5:
            images[i, 0, rows, :] = 1.0
        else:
            images[i, 0, :, rows] = 1.0
    return images


def run(device, steps, workdir, resume_from=None):
    torch.manual_seed(0)
    data_gen = torch.Generator().manual_seed(1)
    train_set, test_set = TensorDataset(bars(8 * BATCH, data_gen)), TensorDataset(bars(2 * BATCH, data_gen))
    shuffle_gen = torch.Generator().manual_seed(2)  # the sampler's own (see test_cnn_classifier)
    noise_gen = torch.Generator().manual_seed(3)  # reparameterisation noise, drawn on the CPU
    train_loader = DataLoader(train_set, batch_size=BATCH, sampler=RandomSampler(train_set, generator=shuffle_gen),
                              num_workers=2, pin_memory=True, persistent_workers=True)
    test_loader = DataLoader(test_set, batch_size=BATCH, pin_memory=True)
    steps_per_epoch = len(train_loader)

    model = VAE().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.7)
    start = 0
    if resume_from is not None:
        checkpoint = torch.load(resume_from, map_location=device)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        shuffle_gen.set_state(checkpoint["shuffle_rng"].cpu())  # map_location moved it too
        noise_gen.set_state(checkpoint["noise_rng"].cpu())
        start = checkpoint["step"]
    fixed_z = torch.randn(4, LATENT, generator=torch.Generator().manual_seed(4)).to(device)

    history = {name: {} for name in ("loss", "grad_norm", "lr", "mu_weight", "test_loss", "samples")}
    step = start
    while step < steps:
        model.train()
        for (x,) in train_loader:
            x = x.to(device, non_blocking=True)
            eps = torch.randn(x.size(0), LATENT, generator=noise_gen).to(device, non_blocking=True)
            recon, mu, logvar = model(x, eps)
            loss = loss_function(recon, x, mu, logvar)
            optimizer.zero_grad()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=100.0)
            optimizer.step()
            history["loss"][step] = loss.detach()
            history["grad_norm"][step] = grad_norm
            history["lr"][step] = optimizer.param_groups[0]["lr"]
            history["mu_weight"][step] = model.fc_mu.weight[0, :8].detach().clone()
            if step % LOG_EVERY == 0:
                print(f"Train step {step}: loss {loss.item():.3f}")
            step += 1
            if step == steps:
                break
        if step % steps_per_epoch == 0:
            scheduler.step()
            model.eval()
            test_loss = 0.0
            with torch.no_grad():
                for (x,) in test_loader:
                    x = x.to(device, non_blocking=True)
                    recon, mu, logvar = model(x, torch.zeros(x.size(0), LATENT, device=device))  # the mean
                    test_loss += loss_function(recon, x, mu, logvar).item() * x.size(0)
                samples = torch.sigmoid(model.decode(fixed_z))
            history["test_loss"][step - 1] = test_loss / len(test_set)
            history["samples"][step - 1] = samples
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "shuffle_rng": shuffle_gen.get_state(),
                        "noise_rng": noise_gen.get_state(), "step": step},
                       os.path.join(workdir, f"ckpt_{step}.pt"))
    return history


def check(cpu, tpu, steps):
    assert_histories_match(cpu, tpu)
    assert tpu["test_loss"][steps - 1] < 0.85 * tpu["loss"][0], "the VAE did not learn"


def test_vae_matches_cpu_and_resumes(tmp_path):
    steps = 24  # three epochs
    cpu, tpu = run_on_cpu_and_tpu(run, steps, tmp_path)
    check(cpu, tpu, steps)
    assert_resumes_identically(run, "tpu", steps, tmp_path, tpu, from_step=16)


@pytest.mark.slow
def test_vae_fused_eager_matches_cpu(tmp_path):
    steps = 24
    check(*run_on_cpu_and_tpu(run, steps, tmp_path, tpu_eager_mode="DEFER_AND_FUSE"), steps)
