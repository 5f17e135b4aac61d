"""A GAN learning a ring of eight Gaussians, trained like the DCGAN example (with MLPs).

A generator and a discriminator, each with its own Adam (betas 0.5, 0.999) and ``StepLR``;
the optimizers are created before the models are moved to the device; alternate D and G
updates with ``BCEWithLogitsLoss`` and the fake batch detached for D; ``clip_grad_norm_`` on D;
``DataLoader(num_workers=2, pin_memory=True)``; an exponential moving average of G (a
``copy.deepcopy`` of the moved G, updated in place with ``lerp_``); the losses logged with
``.item()``; samples from a fixed noise batch under ``G.eval()``/``torch.no_grad()``; a
checkpoint of the three models and both optimizers, resumed into fresh ones.

The latent noise is drawn on the CPU from a seeded generator and moved to the device: random
numbers drawn on ``tpu`` differ from the CPU's, and the comparison needs the same noise.
"""

import copy
import math
import os

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from program_harness import assert_histories_match, assert_resumes_identically, run_on_cpu_and_tpu

NZ, BATCH = 4, 64
EMA_DECAY = 0.9
LOG_EVERY = 5


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(NZ, 64), nn.ReLU(True), nn.Linear(64, 64), nn.ReLU(True), nn.Linear(64, 2))

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Linear(2, 64), nn.LeakyReLU(0.2, inplace=True), nn.Linear(64, 64), nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(64, 1),
        )

    def forward(self, x):
        return self.main(x).view(-1)


def ring(n: int, generator: torch.Generator) -> torch.Tensor:
    angle = torch.randint(0, 8, (n,), generator=generator) * (2 * math.pi / 8)
    centres = torch.stack([angle.cos(), angle.sin()], dim=1) * 2.0
    return centres + 0.05 * torch.randn(n, 2, generator=generator)


def run(device, steps, workdir, resume_from=None):
    torch.manual_seed(0)
    data_gen = torch.Generator().manual_seed(1)
    train_set = TensorDataset(ring(8 * BATCH, data_gen))
    shuffle_gen = torch.Generator().manual_seed(2)  # the sampler's own (see test_cnn_classifier)
    noise_gen = torch.Generator().manual_seed(3)  # latent noise, drawn on the CPU
    sampler = RandomSampler(train_set, generator=shuffle_gen)
    loader = DataLoader(train_set, batch_size=BATCH, sampler=sampler, drop_last=True,
                        num_workers=2, pin_memory=True, persistent_workers=True)
    steps_per_epoch = len(loader)

    netG, netD = Generator(), Discriminator()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=5e-3, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=5e-3, betas=(0.5, 0.999))
    schedulerD = torch.optim.lr_scheduler.StepLR(optimizerD, step_size=10, gamma=0.5)
    schedulerG = torch.optim.lr_scheduler.StepLR(optimizerG, step_size=10, gamma=0.5)
    netG.to(device)  # after the optimizers were made: they must update the moved parameters
    netD.to(device)
    same = all(a is b for opt, net in ((optimizerG, netG), (optimizerD, netD))
               for a, b in zip(opt.param_groups[0]["params"], net.parameters()))
    assert same, "the optimizers hold parameters the models no longer use"
    netG_ema = copy.deepcopy(netG).eval().requires_grad_(False)  # an exponential moving average of G

    start = 0
    if resume_from is not None:
        checkpoint = torch.load(resume_from, map_location=device)
        netG.load_state_dict(checkpoint["G"])
        netD.load_state_dict(checkpoint["D"])
        netG_ema.load_state_dict(checkpoint["G_ema"])
        optimizerG.load_state_dict(checkpoint["optG"])
        optimizerD.load_state_dict(checkpoint["optD"])
        schedulerG.load_state_dict(checkpoint["schedG"])
        schedulerD.load_state_dict(checkpoint["schedD"])
        shuffle_gen.set_state(checkpoint["shuffle_rng"].cpu())  # map_location moved it too
        noise_gen.set_state(checkpoint["noise_rng"].cpu())
        start = checkpoint["step"]

    criterion = nn.BCEWithLogitsLoss()
    fixed_noise = torch.randn(16, NZ, generator=torch.Generator().manual_seed(4)).to(device)
    names = ("lossD", "lossG", "D_x", "D_G_z", "gradD", "lr", "G_weight", "samples", "samples_ema", "spread")
    history = {name: {} for name in names}
    step = start
    while step < steps:
        for (real,) in loader:
            real = real.to(device, non_blocking=True)
            # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            output = netD(real)
            errD_real = criterion(output, torch.ones_like(output))
            D_x = torch.sigmoid(output).mean()
            noise = torch.randn(real.size(0), NZ, generator=noise_gen).to(device, non_blocking=True)
            fake = netG(noise)
            output = netD(fake.detach())
            errD_fake = criterion(output, torch.zeros_like(output))
            errD = errD_real + errD_fake
            errD.backward()
            gradD = nn.utils.clip_grad_norm_(netD.parameters(), max_norm=5.0)
            optimizerD.step()
            # (2) Update G: maximize log(D(G(z)))
            netG.zero_grad()
            output = netD(fake)
            errG = criterion(output, torch.ones_like(output))
            errG.backward()
            D_G_z = torch.sigmoid(output).mean()
            optimizerG.step()
            with torch.no_grad():
                for p_ema, p in zip(netG_ema.parameters(), netG.parameters()):
                    p_ema.lerp_(p, 1 - EMA_DECAY)

            history["lr"][step] = schedulerG.get_last_lr()[0]
            schedulerD.step()
            schedulerG.step()
            for name, value in (("lossD", errD), ("lossG", errG), ("D_x", D_x), ("D_G_z", D_G_z), ("gradD", gradD)):
                history[name][step] = value.detach()
            history["G_weight"][step] = netG.main[4].weight.detach().clone()
            if step % LOG_EVERY == 0:
                print(f"[{step}/{steps}] Loss_D: {errD.item():.4f} Loss_G: {errG.item():.4f} D(x): {D_x.item():.4f}")
            step += 1
            if step == steps:
                break
        if step % steps_per_epoch == 0:
            netG.eval()
            with torch.no_grad():
                samples = netG(fixed_noise)
                samples_ema = netG_ema(fixed_noise)
            netG.train()
            history["samples"][step - 1] = samples
            history["samples_ema"][step - 1] = samples_ema
            history["spread"][step - 1] = samples.norm(dim=1).mean().item()
            torch.save({"G": netG.state_dict(), "D": netD.state_dict(), "G_ema": netG_ema.state_dict(),
                        "optG": optimizerG.state_dict(), "optD": optimizerD.state_dict(),
                        "schedG": schedulerG.state_dict(), "schedD": schedulerD.state_dict(),
                        "shuffle_rng": shuffle_gen.get_state(),
                        "noise_rng": noise_gen.get_state(), "step": step},
                       os.path.join(workdir, f"ckpt_{step}.pt"))
    return history


def check(cpu, tpu, steps):
    assert_histories_match(cpu, tpu)
    # G's samples spread out toward the ring (radius 2) as it learns: a frozen G stays put.
    assert tpu["spread"][steps - 1] > 1.5 * tpu["spread"][7], "the generator did not learn"


def test_gan_matches_cpu_and_resumes(tmp_path):
    steps = 24  # three epochs
    cpu, tpu = run_on_cpu_and_tpu(run, steps, tmp_path)
    check(cpu, tpu, steps)
    assert_resumes_identically(run, "tpu", steps, tmp_path, tpu, from_step=16)


@pytest.mark.slow
def test_gan_fused_eager_matches_cpu(tmp_path):
    steps = 24
    check(*run_on_cpu_and_tpu(run, steps, tmp_path, tpu_eager_mode="DEFER_AND_FUSE"), steps)
