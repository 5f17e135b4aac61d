"""Moved to ``torchtpu.device.dlpack`` (installed at import, below the eager layer); kept so that
``from torchtpu.eager import dlpack`` still finds ``install``."""

from torchtpu.device.dlpack import install  # noqa: F401
