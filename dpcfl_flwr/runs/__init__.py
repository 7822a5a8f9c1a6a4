"""Running experiments on this machine: simulation, comparison grids, probes, progress."""
