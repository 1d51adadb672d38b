"""The MCP client: the servers of `--mcp-config` connected, their tools listed and called (knows nothing of serve/)."""
