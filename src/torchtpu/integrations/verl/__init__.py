"""VeRL on ``tpu``: a platform for VeRL's ``verl.plugin.platform`` (``platform.py``).

VeRL imports every ``verl.plugins`` entry point when ``verl`` is imported; torchtpu's
(``pyproject.toml``: ``tpu = "torchtpu.integrations.verl.platform"``) registers the ``tpu``
platform there. Nothing in VeRL is patched. Importing this package imports no VeRL.
"""
