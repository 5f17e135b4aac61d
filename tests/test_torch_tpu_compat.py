"""The ``torch_tpu`` import name: what libraries that integrated TorchTPU by that name touch
(Transformers' ``find_spec``, Ray Train's ``torch_tpu._loader.load()``, the module attributes).
Import order matters (autoload, ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``), so those cases run in fresh
processes."""

import importlib.util
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch
from setuptools import find_packages

import torch_tpu
import torch_tpu._loader
import torchtpu
from torch_tpu import api

ROOT = Path(__file__).parents[1]


def _run(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter (this one's environment plus ``env``); its stdout."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=240, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_find_spec_and_the_wheel_ships_it():
    spec = importlib.util.find_spec("torch_tpu")
    assert spec is not None and spec.origin.endswith(os.path.join("torch_tpu", "__init__.py"))
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT / found["where"][0]), include=found.get("include", ("*",)))
    assert {"torch_tpu", "torchtpu", "torchtpu.runtime"} <= set(packages)


def test_loader_without_autoload_as_ray_train():
    """Ray's tests set TORCH_DEVICE_BACKEND_AUTOLOAD=0: load() alone must bring the device and the
    backend, start nothing, be idempotent, and the train function then runs on 'tpu_dist'."""
    out = _run("""
        import sys, datetime
        import torch, torch.distributed as dist
        assert not hasattr(torch, "tpu")
        import torch_tpu._loader
        torch_tpu._loader.load()
        torch_tpu._loader.load()
        assert "tpu_dist" in dist.Backend.backend_list and "tpu" in dist.Backend.backend_list
        assert dist.Backend.default_device_backend_map["tpu"] == "tpu"
        assert not torch.tpu.is_initialized() and "jax" not in sys.modules
        dist.init_process_group("tpu_dist", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        assert dist.get_backend() == "tpu_dist"
        tensor = torch.ones(1, device="tpu")
        dist.all_reduce(tensor)
        assert tensor.item() == dist.get_world_size()
        dist.destroy_process_group()
        print("ok")
    """, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert out.strip() == "ok"


@pytest.mark.parametrize("first", ["import torch; import torch_tpu", "import torch_tpu; import torch"])
def test_import_order_with_autoload(first):
    """With autoload on, torch has registered everything before torch_tpu is imported (or the
    other way round): importing it again registers nothing twice and starts nothing."""
    out = _run(f"""
        import sys
        {first}
        import torch_tpu._loader, torchtpu
        torch_tpu._loader.load()
        print(torch.tpu.is_initialized(), "jax" in sys.modules, torch_tpu.__version__ == torchtpu.__version__)
        print(torch.randn(2, device="tpu").device)
    """)
    assert out.split("\n")[:2] == ["False False True", "tpu:0"]


def test_transformers_availability_check():
    """Transformers <= 5.19's is_torch_tpu_available(check_device=True), step by step."""
    assert importlib.util.find_spec("torch_tpu") is not None
    assert hasattr(torch, "tpu") and torch.tpu.is_available()
    assert torch.tpu.device_count() >= 1


def test_module_attributes_are_torchtpus():
    assert torch_tpu.__version__ == torchtpu.__version__
    assert torch_tpu.is_available is torch.tpu.is_available
    assert torch_tpu.device_count is torch.tpu.device_count
    assert torch_tpu.current_device is torch.tpu.current_device
    assert torch_tpu.set_device is torch.tpu.set_device
    assert torch_tpu.synchronize is torch.tpu.synchronize  # the rest: torch.tpu's
    assert torch_tpu.memory_allocated is torch.tpu.memory_allocated
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        torch_tpu.no_such_name  # noqa: B018


def test_api_tpu_device_follows_the_current_device():
    assert api.tpu_device() == torch.device("tpu", 0)
    with torch.tpu.device(2):
        assert api.tpu_device() == torch.device("tpu", 2)
        assert torch.ones(1, device=api.tpu_device()).device == torch.device("tpu", 2)


def test_init_device():
    torch_tpu._loader._init_device("tpu")
    with pytest.raises(ValueError, match="'tpu' device only"):
        torch_tpu._loader._init_device("cuda")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_real_transformers_sees_the_device():
    out = _run("""
        from transformers.utils import import_utils
        check = getattr(import_utils, "is_torch_tpu_available", None)
        print(check is None or check(check_device=True))
    """)
    assert out.strip().endswith("True")


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_real_ray_tpu_device_manager():
    out = _run("""
        import torch
        from ray.air._internal.device_manager.tpu import TPUTorchDeviceManager
        manager = TPUTorchDeviceManager()
        manager.register_custom_torch_dist_backend()
        assert manager.is_available()
        print([d.type for d in manager.get_devices()])
    """, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert out.strip().endswith("['tpu']")
