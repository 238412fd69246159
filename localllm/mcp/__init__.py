"""MCP tools in localllm's own chats: the servers mcp.json names (config.py), their connections over the official
SDK on a thread of their own (sessions.py), and the one tool loop the terminal chat, the TUI and the web page share
(tool_loop.py). The `mcp` package is an optional dependency, imported only when a server starts."""
