"""Privacy accounting and mechanisms, plain math without Flower: the two accountants behind one
interface (accountants.py) and the history they read (history.py), sampled-Gaussian RDP
(rdp.py) and PLD (pld.py), schedules and calibration of z, the budget split, the exponential
mechanism (selection.py), private evaluation metrics, the ledger, and the Euclidean Laplace
mechanism of d-privacy (dprivacy.py). Import from the module that defines a name."""
