"""The measurement lab: load tests (`bench`), capacity arithmetic (`plan`), the simulator (`sim`),
the endpoint checks (`check`), and the measurement and calibration code behind them.

It stands on the engine's public API only (`EngineArgs`, `LLM`, the HTTP API, the torch-free
scheduler and KV manager, the model's public profiling entry points), and nothing outside the lab
imports it except the command line (`kvserve bench|plan|simulate|check`); tests/project/test_layers.py
enforces both (docs/design.md).
"""
