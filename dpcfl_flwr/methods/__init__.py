"""The federated methods, one module each: R-DPCFL and the paper's baselines.

Every module here is imported by :mod:`dpcfl_flwr.config.registry` the first time the registry is
read; each method class registers itself with ``@register``. The interface is
:class:`dpcfl_flwr.methods.base.Method` (docs/adding-a-method.md).
"""
