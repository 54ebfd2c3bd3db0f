"""Generated stubs for k8s.io.apimachinery.pkg.api.resource (Quantity)."""
