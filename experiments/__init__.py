"""Experiment modules (model, data, train step, eval) and benchmark scripts.

The library (flodl_exp/) never imports this package; configs point at it with
``_target_`` dotted paths, so a user adds an experiment with one module and
one yaml under conf/experiment/.
"""
