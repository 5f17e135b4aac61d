"""Set-up for the program tests (``tests/conftest.py`` already selects XLA:CPU for ``tpu``)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """Run the CPU reference on one intra-op thread.

    These tensors are tiny: one thread is the fastest setting, and on a loaded 2-core machine
    ATen's OpenMP threads spinning against XLA's own thread pool made the CPU runs 10-50x
    slower (a conv backward at batch 32: ~1 ms on one thread, 50-250 ms on two). Results do not
    depend on it beyond rounding, which the tolerances cover.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
