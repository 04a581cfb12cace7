"""The progress line: drawn on a terminal, silent otherwise; the loops that use it keep their output."""

from __future__ import annotations

import io

from kvserve.progress import progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_tty_and_yields_every_item():
    stream = _Tty()
    assert list(progress(range(5), 5, "loading", stream=stream)) == [0, 1, 2, 3, 4]
    text = stream.getvalue()
    assert "loading [" in text and "5/5" in text and text.endswith("\n")


def test_progress_is_silent_when_not_a_tty():
    stream = io.StringIO()
    assert list(progress(iter("abc"), 3, "quantising", stream=stream)) == ["a", "b", "c"]
    assert stream.getvalue() == ""


def test_model_load_and_quantisation_print_nothing_in_a_pipe(tmp_path, capsys):
    from kvserve.model.loader import read_checkpoint
    from kvserve.quant.convert import rtn_quantize
    from kvserve.quant.scheme import parse_weight_scheme
    from tests.checkpoints import build_checkpoint

    build_checkpoint(tmp_path / "m")
    capsys.readouterr()  # transformers' own save progress
    checkpoint = read_checkpoint(tmp_path / "m")
    quantized = rtn_quantize(checkpoint, parse_weight_scheme("int8"))
    assert checkpoint and quantized
    assert capsys.readouterr().err == ""
