"""Metrics: the collector behind ``module.log``, the training-loss tracker, and plots."""
