"""kvserve.plan."""
