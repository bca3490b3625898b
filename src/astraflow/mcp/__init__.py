"""``astraflow mcp``: the run as Model Context Protocol tools, for an agent as maintainer."""
