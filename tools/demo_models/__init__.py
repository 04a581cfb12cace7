"""Reproducible pipeline for the embedded demo models (issue 4); see README.md."""
