"""SGLang on ``tpu``: a platform plugin, an attention backend of torchtpu ops, a paged KV pool.

SGLang finds this package through two entry points (``pyproject.toml``):

- ``sglang.srt.platforms``: ``tpu = torchtpu.integrations.sglang:activate``. SGLang calls it
  in every process that resolves its platform; it returns the platform class's name when
  ``SGLANG_PLATFORM=tpu`` (or, unset, when ``tpu`` is the accelerator and CUDA is not there).
- ``sglang.srt.plugins``: ``torchtpu = torchtpu.integrations.sglang:register``, which adds the
  ``tpu`` attention backend to SGLang's registry and to ``--attention-backend``'s choices,
  ``--quantization tpu_int8``, and the hooks that run tensor parallelism on tpu (:mod:`.parallel`).

Nothing here imports SGLang at torchtpu's import time.
"""

from __future__ import annotations

from torchtpu.integrations import check_version, serving_on_tpu
from torchtpu.integrations.sglang.names import BACKEND_NAME

# The SGLang releases this integration was written and tested against; its platform
# interface changes between minor releases, so others are refused rather than half-working.
TESTED_SGLANG = ((0, 5, 23), (0, 5, 24))  # [low, high)
PLATFORM_CLASS = "torchtpu.integrations.sglang.platform.TpuSRTPlatform"


def check_sglang_version(installed: str | None = None) -> str:
    """The installed sglang version (or ``installed``); raise if it is outside the tested range."""
    return check_version("sglang", TESTED_SGLANG, installed)


def activate() -> str | None:
    """Entry point of ``sglang.srt.platforms``: the platform class's name, or None to decline."""
    if not serving_on_tpu("SGLANG_PLATFORM"):
        return None
    check_sglang_version()
    # SGLang resolves its platform while `import sglang` is still running: importing its
    # attention registry here would be circular; `register` runs later, from load_plugins.
    return PLATFORM_CLASS


def register() -> None:
    """Entry point of ``sglang.srt.plugins``: make ``--attention-backend tpu`` and
    ``--quantization tpu_int8`` known to SGLang."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from torchtpu.integrations.sglang import parallel, quantization

    quantization.register()
    if BACKEND_NAME in ATTENTION_BACKENDS:
        return
    parallel.register_hooks()

    def create(model_runner):
        from torchtpu.integrations import serving_process_defaults
        from torchtpu.integrations.sglang.allocator import host_free_list
        from torchtpu.integrations.sglang.attention import TpuAttnBackend

        # The backend is built in the model process once its pools exist and before the
        # scheduler allocates from them: the moment to move the free list to the host (SGLang
        # has no allocator hook for page size 1) and to set the process's serving defaults.
        serving_process_defaults()
        host_free_list(model_runner)
        return TpuAttnBackend(model_runner)

    ATTENTION_BACKENDS[BACKEND_NAME] = create
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        ATTENTION_BACKEND_CHOICES.append(BACKEND_NAME)
