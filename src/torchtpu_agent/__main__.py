"""``python -m torchtpu_agent``: the MCP server on stdio (the same as ``torchtpu mcp``, without importing torch)."""

import sys

from torchtpu_agent.server import main

sys.exit(main())
