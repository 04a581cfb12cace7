"""The command line's progress line lives in kvserve.progress (the loader and the quantiser use it
too); this name stays for the commands that import it from here."""

from kvserve.progress import progress

__all__ = ["progress"]
