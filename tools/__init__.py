"""Developer tools of the TorchRec fork (see CONTRIBUTING.md)."""
