"""Generated stubs for the CRI runtime API."""
