"""kvserve.runner."""
