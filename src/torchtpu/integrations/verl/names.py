"""The names torchtpu's VeRL platform answers with (no VeRL import: the tests and tools read them)."""

PLATFORM_NAME = "tpu"  # VERL_PLATFORM=tpu
DEVICE = "tpu"
COMMUNICATION_BACKEND = "tpu_dist"  # torchtpu's c10d backend ("tpu" works too)
RAY_RESOURCE = "TPU"
VISIBLE_DEVICES_VARIABLE = "TPU_VISIBLE_CHIPS"  # what Ray sets for a worker holding TPU resources
