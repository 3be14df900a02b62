"""Real single-node Kubernetes cluster harness and end-to-end scenarios for kxpu (needs root)."""
