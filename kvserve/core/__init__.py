"""kvserve.core."""
