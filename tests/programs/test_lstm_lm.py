"""A word-level LSTM language model with a tied embedding, as in PyTorch's word_language_model.

The script builds the model, creates its optimizer, and only then moves the model to the
device (the optimizer must keep working: ``.to()`` moves parameters in place). The decoder
shares the embedding's weight; it must stay shared after ``.to(device)`` and be counted once.
Truncated BPTT: the hidden state is carried across batches and detached. Adam, a warm-up
``LambdaLR``, ``clip_grad_norm_``, the loss logged with ``.item()``, an eval loop (perplexity)
under ``model.eval()``/``torch.no_grad()``, greedy generation, and a checkpoint each epoch
resumed into a fresh model with ``load_state_dict``. Dropout is 0 so nothing random runs on
the device (its dropout masks would differ from the CPU's).
"""

import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from program_harness import (
    assert_greedy_choices_are_robust,
    assert_histories_match,
    assert_resumes_identically,
    run_on_cpu_and_tpu,
)

VOCAB, EMBED, LAYERS = 24, 32, 2
BATCH, BPTT = 8, 12
LOG_EVERY = 4


class LSTMLM(nn.Module):
    def __init__(self, vocab=VOCAB, d=EMBED, layers=LAYERS, dropout=0.0):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab, d)
        self.rnn = nn.LSTM(d, d, num_layers=layers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(d, vocab)
        self.decoder.weight = self.encoder.weight  # weight tying (Press & Wolf 2017)

    def forward(self, tokens, hidden=None):
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return self.decoder(self.drop(output)), hidden


def corpus(n_sentences: int, generator: torch.Generator) -> torch.Tensor:
    """Sentences that count up with a stride of 1, 2 or 3 (mod VOCAB - 1), each ended by token 0."""
    sentences = []
    for _ in range(n_sentences):
        start = int(torch.randint(1, VOCAB, (1,), generator=generator))
        stride = int(torch.randint(1, 4, (1,), generator=generator))
        length = int(torch.randint(4, 9, (1,), generator=generator))
        sentences += [1 + (start - 1 + stride * i) % (VOCAB - 1) for i in range(length)] + [0]
    return torch.tensor(sentences)


def batchify(stream: torch.Tensor, batch: int, bptt: int) -> TensorDataset:
    """Cut ``stream`` into ``batch`` parallel streams and those into (input, target) chunks.

    The dataset's item i of every stream follows item i - 1 of the same stream, so a loader
    without shuffling hands the LSTM contiguous text and the carried hidden state stays valid.
    """
    n = (stream.numel() - 1) // (batch * bptt) * (batch * bptt)
    x = stream[:n].view(batch, -1, bptt).transpose(0, 1)  # (chunks, batch, bptt)
    y = stream[1 : n + 1].view(batch, -1, bptt).transpose(0, 1)
    return TensorDataset(x.contiguous(), y.contiguous())


def evaluate(model, loader, device):
    model.eval()
    total, count, hidden = 0.0, 0, None
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, hidden = model(x, hidden)
            total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    model.train()
    return total / count


@torch.no_grad()
def generate(model, prompt, new_tokens):
    """Greedy decoding, feeding the whole growing sequence each step."""
    model.eval()
    tokens, logits_seen = prompt, []
    for _ in range(new_tokens):
        logits, _ = model(tokens)
        logits_seen.append(logits[:, -1])
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    model.train()
    return tokens, torch.stack(logits_seen, 1)


def run(device, steps, workdir, resume_from=None):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    train_set = batchify(corpus(300, gen), BATCH, BPTT)
    val_set = batchify(corpus(40, gen), BATCH, BPTT)
    # No shuffling: the chunks must come in order for the carried hidden state.
    train_loader = DataLoader(train_set, batch_size=None, num_workers=2, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=None, pin_memory=True)
    steps_per_epoch = len(train_set)

    model = LSTMLM()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)  # created before the move
    warmup = 5
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    model.to(device)
    tied = model.decoder.weight is model.encoder.weight
    assert tied, "the weights came untied"
    assert sum(p.numel() for p in model.parameters()) == n_params
    assert all(p.device.type == torch.device(device).type for p in model.parameters())
    same = all(a is b for a, b in zip(optimizer.param_groups[0]["params"], model.parameters()))
    assert same, "the optimizer holds parameters the model no longer uses"

    start = 0
    if resume_from is not None:
        checkpoint = torch.load(resume_from, map_location=device)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        start = checkpoint["step"]
        tied = model.decoder.weight is model.encoder.weight
        assert tied, "load_state_dict untied the weights"

    history = {name: {} for name in ("loss", "grad_norm", "lr", "embedding", "eval_loss", "tokens", "gen_logits")}
    history["n_params"] = {0: n_params}
    step = start
    while step < steps:
        hidden = None
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if hidden is not None:
                hidden = tuple(h.detach() for h in hidden)  # truncated BPTT
            logits, hidden = model(x, hidden)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            history["lr"][step] = scheduler.get_last_lr()[0]
            scheduler.step()

            history["loss"][step] = loss.detach()
            history["grad_norm"][step] = grad_norm
            history["embedding"][step] = model.encoder.weight[3, :8].detach().clone()
            if step % LOG_EVERY == 0:
                print(f"step {step:3d} | loss {loss.item():5.2f} | ppl {math.exp(loss.item()):7.2f}")
            step += 1
            if step == steps:
                break
        if step % steps_per_epoch == 0 or step == steps:
            history["eval_loss"][step - 1] = evaluate(model, val_loader, device)
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "step": step},
                os.path.join(workdir, f"ckpt_{step}.pt"),
            )

    prompt = torch.tensor([[5, 7, 9], [2, 3, 4]]).to(device)
    tokens, gen_logits = generate(model, prompt, new_tokens=5)
    history["tokens"][step - 1] = tokens.tolist()
    history["gen_logits"][step - 1] = gen_logits
    return history


def check(cpu, tpu, steps):
    # Tied: the embedding, the LSTM (4 gates, 2 layers, two biases each) and the decoder's bias.
    assert cpu["n_params"][0] == VOCAB * EMBED + LAYERS * 4 * EMBED * (2 * EMBED + 2) + VOCAB
    assert_greedy_choices_are_robust(cpu["gen_logits"][steps - 1], tpu["gen_logits"][steps - 1])
    assert_histories_match(cpu, tpu)
    losses = list(tpu["loss"].values())
    assert sum(losses[-4:]) < 0.6 * sum(losses[:4]), "the model did not learn"


def epoch_steps():
    return len(batchify(corpus(300, torch.Generator().manual_seed(1)), BATCH, BPTT))


def test_lstm_lm_matches_cpu_and_resumes(tmp_path):
    steps = epoch_steps() * 3 // 2
    cpu, tpu = run_on_cpu_and_tpu(run, steps, tmp_path)
    check(cpu, tpu, steps)
    assert_resumes_identically(run, "tpu", steps, tmp_path, tpu, from_step=epoch_steps())


@pytest.mark.slow
def test_lstm_lm_fused_eager_matches_cpu(tmp_path):
    steps = epoch_steps() * 3 // 2
    check(*run_on_cpu_and_tpu(run, steps, tmp_path, tpu_eager_mode="DEFER_AND_FUSE"), steps)
