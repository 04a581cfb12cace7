"""Test-only fault injection for the async engine (`kvserve serve --inject-fault ...`), and the stand-in
engine that maintenance calls see once the real one is dead."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FaultInjection:
    """Test-only faults, keyed by a request's seed: `request_seed` makes the runner fail while preparing
    that request (inside a step: attributable); `engine_seed` makes the loop itself fail after the step
    that follows its arrival (not attributable: the engine dies)."""

    request_seed: int | None = None
    engine_seed: int | None = None
    step_delay_s: float = (
        0.0  # sleep after every step: a slow engine, for deterministic timing tests
    )
    grammar_delay_s: float = 0.0  # sleep in every grammar compile (not a cache hit): a slow compile

    @classmethod
    def parse(cls, spec: str | None) -> FaultInjection | None:
        """`request:SEED`, `engine:SEED`, `delay:SECONDS`, `grammar:SECONDS`, comma-separated."""
        if not spec:
            return None
        fields: dict[str, float] = {}
        for part in spec.split(","):
            kind, _, value = part.partition(":")
            try:
                if kind == "delay":
                    fields["step_delay_s"] = float(value)
                elif kind == "grammar":
                    fields["grammar_delay_s"] = float(value)
                elif kind in ("request", "engine"):
                    fields[f"{kind}_seed"] = int(value)
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(
                    "fault injection must be request:SEED, engine:SEED, delay:SECONDS or "
                    f"grammar:SECONDS; "
                    f"got {part!r}"
                ) from None
        return cls(**fields)


def inject_runner_fault(runner, seed: int) -> None:
    """Make `runner` fail while preparing any request with this seed (inside a step)."""
    add_request = runner.add_request

    def failing_add_request(new):
        if new.sampling_params.seed == seed:
            raise RuntimeError("injected fault while preparing a request")
        return add_request(new)

    runner.add_request = failing_add_request


class DeadEngine:
    """Stands in for the engine in maintenance calls that arrive after it died: any use raises."""

    def __init__(self, error: Exception) -> None:
        self._error = error

    def __getattr__(self, name: str):
        raise self._error
