"""kvserve.lab.check: self-checks a user can run on a model or a live server.

- `invariance`  the comparison: tokens equal or the first differing position, the largest
                difference in log probability, the smallest top-two gap at which the argmax held
- `shapes`      the batch shapes of the batch-invariance check, offline through the engine
- `endpoint`    the same check against a running OpenAI-compatible server
- `report`      the JSON report and the one-screen summary

Definitions: docs/determinism.md.
"""
