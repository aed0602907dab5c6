"""Evaluation: validate, test and predict, and which weights they use."""
