"""Names SGLang knows torchtpu by, below the modules that use them (the package's entry points and
the platform class, which the entry points load lazily: importing them from the package would close
a cycle). Imports nothing."""

BACKEND_NAME = "tpu"
"""``--attention-backend tpu``; also what the platform reports as its default attention backend."""
