"""The CRI streaming server: Exec, Attach and PortForward URLs and the connections they serve."""
