"""Multi-node jobs on TorchElastic: what torchrun's options say about the nodes, and the
launcher's part in a job that many launchers (one per node) run together."""
