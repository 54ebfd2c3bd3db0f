"""NRI: the runtime side of the Node Resource Interface (plugins, their connections, the hooks)."""
