"""Bridges to other libraries' formats and models (``framework.integrations.transformers``)."""
