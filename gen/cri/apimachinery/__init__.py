"""Generated stubs for the k8s.io/apimachinery messages the CRI extension uses."""
