"""torchtpu's agent suite: ``torchtpu mcp``, a Model Context Protocol server (``server``) whose tools run
and diagnose PyTorch code on ``tpu`` in separate processes (``executor``, ``zygote``, ``jobs``), and
suggest checked fixes (``suggest``). A package of its own, beside ``torchtpu``, so that the server
process does not import torch. Docs: docs/agents.md."""
