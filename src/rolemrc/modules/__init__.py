"""LightningModules: own the forward, the reference model and the logging."""
