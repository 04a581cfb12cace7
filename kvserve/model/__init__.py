"""kvserve.model."""
