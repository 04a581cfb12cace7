"""Structured output: grammar-constrained decoding (xgrammar)."""
