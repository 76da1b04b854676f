"""Integrations of xgraph with model libraries.

Each integration is an optional extra (`pip install xgraph[transformers]`); the core never
imports one, and importing an integration package does not import its library until a
function that needs it runs.
"""
