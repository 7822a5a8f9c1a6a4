"""dpcfl-flwr: differentially private clustered federated learning (R-DPCFL) on Flower."""

__version__ = "0.1.0"
