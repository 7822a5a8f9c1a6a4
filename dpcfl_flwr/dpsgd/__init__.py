"""DP-SGD on a silo: the training loop and the per-sample gradient engines."""
