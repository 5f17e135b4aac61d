"""TorchTitan on ``tpu``: the peak its MFU is measured against, and the debug assets its configs
expect, written without a git checkout.

TorchTitan (0.3) picks its device once, at import, with
``torch._utils._get_available_device_type()``. With torchtpu installed that answers ``tpu``
(PyTorch's device autoload registers it), so ``torchrun -m torchtitan.train`` trains on ``tpu``
unchanged. Two of its functions are wrapped (``torchtpu.patches``). ``torchtitan.peak_flops``:
``torchtitan.tools.utils.get_peak_flops`` finds a device's peak FLOP/s by matching its name
against a table of GPUs and TPUs, which misses the names PJRT gives v5e, v5p, v6e and TPU7x
(``TPU v5 lite``, ...) and has no figure for XLA:CPU (it falls back to an A100's), so its MFU
was wrong. For a ``tpu`` device the wrapper answers ``torch.tpu.get_device_properties().peak_flops``
(the chip's published peak, or XLA:CPU's measured matmul rate) and logs where it comes from;
every other device gets TorchTitan's own answer. ``torchtitan.flux_autoencoder_load`` lets FLUX's
autoencoder load onto ``tpu``: TorchTitan reads its safetensors file with ``load_file(path,
device=<the trainer's device>)``, and safetensors refuses device names it does not know
(``device tpu:0 is invalid``); for ``tpu`` the file is read on the CPU and moved.
``--compile.enable`` needs nothing here: its ``backend="inductor"`` compiles graphs on tpu with
the tpu backend (``torchtpu.compile.routing``).

What a pip install lacks is the data: the debug configs read ``./tests/assets/tokenizer`` and
the ``c4_test`` dataset from a TorchTitan git checkout, and the wheel ships neither.
``write_debug_assets`` writes a word-level tokenizer and a generated corpus in the same formats
(``python -m torchtpu.integrations.torchtitan DIR``); pass them with ``--hf_assets_path`` and
``--dataloader.dataset_path``. The CPU reference run lives in ``tools/torchtitan_cpu.py``: it
must run in a process without torchtpu, which this package cannot be imported without.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import logging
import random
import sys
from pathlib import Path

_UTILS = "torchtitan.tools.utils"
_FLUX_AUTOENCODER = "torchtitan.models.flux.model.autoencoder"

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
UNK_TOKEN = "[UNK]"

# A toy grammar: sentences built from these word classes have structure a model can learn
# in a few steps, so the loss curve (what the tests compare) moves rather than staying flat.
_SUBJECTS = "the cat,a dog,my friend,the teacher,our team,the river,a child,the city".split(",")
_VERBS = "sees,likes,builds,finds,follows,paints,reads,visits,opens,carries".split(",")
_OBJECTS = ("a book,the bridge,an apple,the garden,a letter,the mountain,a song,the door,"
            "a small boat,the old house").split(",")
_TAILS = ("today,at night,in the morning,with care,near the sea,after lunch,again,"
          "every day,for a while,quietly").split(",")


def _sentence(rng: random.Random) -> str:
    """One sentence of the toy grammar."""
    return " ".join((rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS),
                     rng.choice(_TAILS))) + " ."


def _documents(count: int, seed: int) -> list[str]:
    """``count`` documents of 5 to 30 sentences, the same for the same seed."""
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(5, 30))) for _ in range(count)]


def _vocabulary() -> list[str]:
    """Every word the grammar uses, sorted so token ids do not depend on set order."""
    words = {w for group in (_SUBJECTS, _VERBS, _OBJECTS, _TAILS) for p in group for w in p.split()}
    return sorted(words | {"."})


def _write_tokenizer(directory: Path) -> None:
    """A word-level ``tokenizer.json`` and a ``tokenizer_config.json`` naming BOS/EOS."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    tokens = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, *_vocabulary()]
    tokenizer = Tokenizer(WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": UNK_TOKEN}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def write_debug_assets(root: str | Path, documents: int = 200, seed: int = 0) -> dict[str, str]:
    """Write a tokenizer and a ``c4_test``-format dataset under ``root``; return their paths.

    Pass them to TorchTitan as ``--hf_assets_path`` and ``--dataloader.dataset_path``.
    """
    root = Path(root)
    tokenizer_dir, dataset_dir = root / "tokenizer", root / "c4_test"
    _write_tokenizer(tokenizer_dir)
    dataset_dir.mkdir(parents=True, exist_ok=True)
    # JSON lines with a "text" field, as TorchTitan's c4_test loader reads them ("train" in the
    # name: the datasets library infers the split from it, and the loader asks for "train").
    with open(dataset_dir / "c4-train.json", "w") as f:
        for text in _documents(documents, seed):
            f.write(json.dumps({"text": text}) + "\n")
    return {"hf_assets_path": str(tokenizer_dir), "dataset_path": str(dataset_dir)}


class _AfterImportPatch:
    """``module.attr`` replaced by ``make(module, original)`` when ``module`` is imported (now, if it
    is already); the replacement keeps the original as ``__wrapped__``, which ``restore`` puts back."""

    def __init__(self, module: str, attr: str, make):
        self.module, self.attr, self.make = module, attr, make

    def install(self) -> bool:
        """False where TorchTitan is not installed."""
        from torchtpu.compile import routing

        if self.module not in sys.modules and importlib.util.find_spec("torchtitan") is None:
            return False
        routing.after_import(self.module, self._wrap)
        return True

    def restore(self) -> None:
        from torchtpu.compile import routing

        routing.cancel_after_import(self.module)
        module = sys.modules.get(self.module)
        original = getattr(getattr(module, self.attr, None), "__wrapped__", None)
        if original is not None:
            setattr(module, self.attr, original)

    def _wrap(self) -> None:
        module = sys.modules[self.module]
        original = getattr(module, self.attr)
        if hasattr(original, "__wrapped__"):
            return
        replacement = self.make(module, original)
        replacement.__wrapped__ = original  # (not functools.wraps: the replacement names itself)
        setattr(module, self.attr, replacement)


def _device_peak(utils, original):
    def get_peak_flops(device_name: str) -> float:
        """TorchTitan's get_peak_flops; for device type tpu, the device's own peak (torchtpu)."""
        if getattr(utils, "device_type", None) != "tpu":
            return original(device_name)
        import torch

        props = torch.tpu.get_device_properties()
        if props.peak_flops is None:  # an accelerator the table lacks: TorchTitan's own guess
            return original(device_name)
        _log_peak(props.name, props.peak_flops, props.peak_flops_source)
        return props.peak_flops

    return get_peak_flops


@functools.cache
def _log_peak(name: str, peak: float, source: str) -> None:
    logging.getLogger("torchtpu").info("MFU is measured against %s's peak of %.3e FLOP/s (%s)",
                                          name, peak, source)


def _load_sft_via_cpu(module, original):
    def load_sft(filename, device="cpu"):
        """safetensors' ``load_file``; for a tpu device, read on the CPU, then moved to the device
        (safetensors accepts only the device names it knows: ``device tpu:0 is invalid``)."""
        import torch

        if torch.device(device).type != "tpu":
            return original(filename, device=device)
        return {name: tensor.to(device) for name, tensor in original(filename, device="cpu").items()}

    return load_sft


_PEAK = _AfterImportPatch(_UTILS, "get_peak_flops", _device_peak)
_FLUX_LOAD = _AfterImportPatch(_FLUX_AUTOENCODER, "load_sft", _load_sft_via_cpu)


def use_device_peak() -> bool:
    """Patch ``torchtitan.peak_flops`` (at the first tpu use): now if TorchTitan's utils are
    imported, else when they are; False where TorchTitan is not installed."""
    return _PEAK.install()


def restore_peak() -> None:
    _PEAK.restore()


def load_flux_autoencoder_on_tpu() -> bool:
    """Patch ``torchtitan.flux_autoencoder_load`` (at the first tpu use): now if TorchTitan's FLUX
    autoencoder module is imported, else when it is; False where TorchTitan is not installed."""
    return _FLUX_LOAD.install()


def restore_flux_autoencoder_load() -> None:
    _FLUX_LOAD.restore()


def main(argv: list[str] | None = None) -> None:
    """``python -m torchtpu.integrations.torchtitan DIR``: write the assets, print their paths."""
    parser = argparse.ArgumentParser(description="Write TorchTitan's debug tokenizer and dataset.")
    parser.add_argument("directory")
    parser.add_argument("--documents", type=int, default=200)
    args = parser.parse_args(argv)
    print(json.dumps(write_debug_assets(args.directory, args.documents)))


if __name__ == "__main__":
    main()
