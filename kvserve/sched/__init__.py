"""kvserve.sched."""
