"""Two settings of the CPU kernels compared in one process, on one engine and one set of inputs.

On a shared host the same tree's decode step moves by a third within an hour, and two processes differ in
more than the setting under test (their pages, their neighbours' phase). Here only the setting changes:
blocks of `--block` calls run under A then B (B then A on odd alternations), `--alternations` times, and
each alternation gives one paired ratio A / B. docs/performance.md, "Measuring a change on a shared host".

Switches (A / B):
  guided               each thread a fixed half of a linear's panels / panels claimed in chunks
  pooled               the step forks and joins per linear / the pooled step (one parallel region
                       whose thread pool stays up for the whole step)
  isa:LEVEL,LEVEL      the kernels capped at an ISA level (scalar, avx2, avx512), e.g. isa:avx2,avx512
  norms                Gemma's offset RMSNorms (the q, k and layer norms) as torch ops / on the C
                       RMSNorm scaled by 1 + w (model/decoder.py OffsetRMSNorm); models without
                       them are refused
  sources:DIR          the package's C sources / the C files in DIR, a modified copy of
                       kvserve/model/csrc with the same structs (both builds loaded side by side);
                       sources:DIR_A,DIR_B compares two such copies

Targets:
  step    the fused decode step, on inputs captured from a real batch (`--batch` rows at `--context`)
  head    the LM head on that step's rows
  linear  one of the model's own quantised linears on the panel layout (the first whose name contains
          `--linear`), `--batch` random rows through the native panel GEMV / GEMM (small_linear)
  decode  the whole engine: each block generates `--block` greedy tokens per row; the time per decode
          step is (last token - first token) / (tokens - 1), as benchmarks/peer_llamacpp.py measures it

Reported: each side's median and minimum per call (ms), the paired ratio A / B (its median, how many
alternations exceed 1, a two-sided sign test), and whether both sides gave the same bits (step and head:
the outputs; decode: the tokens).

    .venv/bin/python benchmarks/ab_switch.py --model DIR --switch guided [--target step] [--batch 1]
        [--context 32] [--quantization FMT] [--alternations 30] [--block 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import kvserve_llm, threads_used, write_report  # noqa: E402


def sign_test_p(above: int, below: int) -> float:
    """Two-sided sign test: the chance of a split at least this uneven if A and B were alike."""
    n = above + below
    if n == 0:
        return 1.0
    k = min(above, below)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


class Switch:
    """`apply("a")` / `apply("b")` puts the kernels in one setting; `restore()` puts back the first."""

    def __init__(self, spec: str, model=None) -> None:
        from kvserve.model import cpu_kernels, fused_decode
        from kvserve.model.decoder import OffsetRMSNorm

        self.lib = cpu_kernels.load_kernel()
        if self.lib is None:
            raise SystemExit("the C kernels are not built here: nothing to switch")
        self.loader = cpu_kernels.load_kernel
        name, _, arg = spec.partition(":")
        if name == "guided":
            self.sides = {"a": lambda: self.lib.decode_set_guided(0),
                          "b": lambda: self.lib.decode_set_guided(1)}  # fmt: skip
            self.labels = ("fixed shares", "guided")
            self._restore = lambda: self.lib.decode_set_guided(1)
        elif name == "pooled":
            self.sides = {"a": lambda: self.lib.decode_set_pooled_step(0),
                          "b": lambda: self.lib.decode_set_pooled_step(1)}  # fmt: skip
            self.labels = ("forking", "pooled")
            self._restore = lambda: self.lib.decode_set_pooled_step(1)
        elif name == "norms":
            norms = [m for m in model.modules() if isinstance(m, OffsetRMSNorm)]
            if not norms:
                raise SystemExit("--switch norms: this model has no offset RMSNorms (Gemma 3's)")

            def set_norms(on: bool) -> None:
                for norm in norms:
                    norm.cpu_kernels = on

            self.sides = {"a": lambda: set_norms(False), "b": lambda: set_norms(True)}
            self.labels = ("torch norms", "C norms")
            self._restore = lambda: set_norms(True)
        elif name == "isa":
            levels = arg.split(",")
            if len(levels) != 2 or any(v not in fused_decode.available_isas() for v in levels):
                raise SystemExit(f"--switch isa:A,B with A, B in {fused_decode.available_isas()}")
            self.sides = {side: (lambda v=v: fused_decode.set_max_isa(v))
                          for side, v in zip("ab", levels, strict=True)}  # fmt: skip
            self.labels = tuple(levels)
            self._restore = fused_decode.reset_isa
        elif name == "sources":
            dirs = arg.split(",")
            if len(dirs) == 1:
                dirs.insert(0, "")  # A: the package's own build
            libs = []
            for d in dirs:
                lib = self.lib if not d else cpu_kernels.build_kernel(Path(d))
                if lib is None:
                    raise SystemExit(f"the C files in {d} did not build (see the log above)")
                libs.append(lib)
            # every caller looks the library up through cpu_kernels.load_kernel at call time
            self.sides = {side: (lambda lib=lib: setattr(cpu_kernels, "load_kernel", lambda: lib))
                          for side, lib in zip("ab", libs, strict=True)}  # fmt: skip
            self.labels = tuple(f"sources in {d}" if d else "package sources" for d in dirs)
            self._restore = lambda: setattr(cpu_kernels, "load_kernel", self.loader)
        else:
            raise SystemExit(
                f"unknown switch {spec!r} (guided, pooled, norms, isa:A,B, sources:[DIR_A,]DIR_B)"
            )

    def apply(self, side: str) -> None:
        self.sides[side]()

    def restore(self) -> None:
        self._restore()


def capture_tokens(rows: int, prompt_tokens: int, budget: int) -> int:
    """Tokens per request for `capture`: prompts longer than a step's token budget end in different
    steps, each row decoding from then on (a decode row takes one token of the budget), so the first
    row must still decode when the last prompt ends."""
    return 3 + -(-prompt_tokens // max(1, budget - rows))


def capture(llm, prompts, greedy) -> dict:
    """The inputs of the last fused step and of the last LM head call of one generate that had a row for
    every prompt: a decode step of the whole batch (a prompt's tokens run as rows of one request share a
    block table, so a step of distinct block tables is one of distinct requests); `capture_tokens`
    tokens each (max_model_len must leave room for them)."""
    rows = len(prompts)
    budget = llm.engine.config.scheduler.max_num_batched_tokens
    params = greedy.with_updates(max_tokens=capture_tokens(rows, sum(map(len, prompts)), budget))
    llm.engine.kv_manager.pool.reset_prefix_cache()  # every prompt computed, as in the first generate

    def whole_batch(block_table) -> bool:
        return (
            block_table.shape[0] == rows and len({tuple(r) for r in block_table.tolist()}) == rows
        )

    import torch

    model = llm.engine.runner.model
    seen: dict = {}
    fused_cls = type(model.fused) if model.fused is not None else None
    head = model.cpu_head
    originals = {}
    if fused_cls is not None:
        originals["fused"] = fused_cls.__call__

        def fused_call(self, *args):
            if whole_batch(args[4]):
                # the tensors copied; the embedding module (an argument since 1203f) as it is
                seen["step"] = (self, [a.clone() if torch.is_tensor(a) else a for a in args])
            return originals["fused"](self, *args)

        fused_cls.__call__ = fused_call
    if head is not None:
        originals["head"] = head.forward

        def head_call(x):
            if x.shape[0] == rows:
                seen["head"] = (head, [x.clone()])
            return originals["head"](x)

        head.forward = head_call
    try:
        llm.generate(prompts, params)
    finally:
        if "fused" in originals:
            fused_cls.__call__ = originals["fused"]
        if "head" in originals:
            del head.forward  # the class's method again
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument(
        "--switch", required=True, help="guided, pooled, isa:A,B or sources:[DIR_A,]DIR_B"
    )
    parser.add_argument("--target", choices=["step", "head", "linear", "decode"], default="step")
    parser.add_argument(
        "--linear", default="gate_up", help="linear target: part of the module's name"
    )
    parser.add_argument("--batch", type=int, default=1, help="rows (requests) in the step")
    parser.add_argument("--context", type=int, default=32, help="prompt tokens per row")
    parser.add_argument("--quantization", default=None, help="as LLM(quantization=...)")
    parser.add_argument(
        "--gguf-activations",
        default="auto",
        help="as LLM(gguf_activations=...), a GGUF model's products",
    )
    parser.add_argument("--alternations", type=int, default=30)
    parser.add_argument("--block", type=int, default=10, help="calls (decode: tokens) per block")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON report")
    args = parser.parse_args()
    llm_cls = kvserve_llm()  # before torch: kvserve's thread defaults apply
    import torch

    from kvserve import SamplingParams

    torch.set_num_threads(args.threads)
    budget, block_size = 2048, 16
    tokens = capture_tokens(args.batch, args.batch * args.context, budget)
    max_model_len = max(512, args.context + max(args.block, tokens) + 8)
    llm = llm_cls(
        args.model,
        quantization=args.quantization,
        gguf_activations=args.gguf_activations,
        max_num_seqs=max(4, args.batch),
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        # every row's whole context at once: a smaller cache would run the last step with fewer rows
        block_size=block_size,
        num_blocks=max(4, args.batch) * -(-max_model_len // block_size) + 8,
    )
    switch = Switch(args.switch, llm.engine.runner.model)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.config.model.vocab_size
    prompts = torch.randint(3, vocab, (args.batch, args.context), generator=gen).tolist()
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    pool = llm.engine.kv_manager.pool

    if args.target == "decode":
        params = greedy.with_updates(max_tokens=args.block + 1)

        def run_block() -> tuple[float, object]:
            pool.reset_prefix_cache()
            outs = llm.generate(prompts, params)
            metrics = [o.outputs[0].metrics for o in outs]
            start = max(m.first_token_time for m in metrics)
            end = max(m.finished_time for m in metrics)
            return (end - start) / args.block, [o.outputs[0].token_ids for o in outs]

    elif args.target == "linear":
        from kvserve.model import fused_decode

        module = next(
            (m for name, m in llm.engine.runner.model.named_modules()
             if args.linear in name and getattr(m, "layout", None) == "panel"),
            None,
        )  # fmt: skip
        if module is None:
            raise SystemExit(
                f"no quantised linear on the panel layout has {args.linear!r} in its name"
            )
        x = torch.randn(args.batch, module.in_features, generator=gen)

        def run_block() -> tuple[float, object]:
            start = time.perf_counter()
            for _ in range(args.block):
                out = fused_decode.small_linear(module._desc, x)
            return (time.perf_counter() - start) / args.block, out

    else:
        llm.generate(prompts, greedy.with_updates(max_tokens=3))  # builds the fused step
        seen = capture(llm, prompts, greedy)
        if args.target not in seen:
            raise SystemExit(
                f"no native {args.target} call had all {args.batch} rows (no C kernels, or more rows "
                "than the fused step takes?)"
            )
        fn, inputs = seen[args.target]

        def run_block() -> tuple[float, object]:
            start = time.perf_counter()
            for _ in range(args.block):
                out = fn(*inputs)
            return (time.perf_counter() - start) / args.block, out

    results = {}
    for side in "ab":
        switch.apply(side)
        run_block()  # warm-up under each setting
        results[side] = run_block()[1]
    if args.target == "decode":
        bits_equal = results["a"] == results["b"]
    else:
        bits_equal = torch.equal(results["a"], results["b"])
    times: dict[str, list[float]] = {"a": [], "b": []}
    for r in range(args.alternations):
        for side in "ab" if r % 2 == 0 else "ba":
            switch.apply(side)
            times[side].append(run_block()[0])
    switch.restore()
    ratios = [a / b for a, b in zip(times["a"], times["b"], strict=True)]
    above, below = sum(x > 1 for x in ratios), sum(x < 1 for x in ratios)
    report = {
        "what": "one setting of the CPU kernels against another, in one process on one engine",
        "switch": args.switch,
        "a": switch.labels[0],
        "b": switch.labels[1],
        "target": args.target,
        "model": args.model,
        "quantization": args.quantization,
        "gguf_activations": args.gguf_activations,
        "linear": module.extra_repr() if args.target == "linear" else None,
        "batch": args.batch,
        "context": args.context,
        "alternations": args.alternations,
        "block": args.block,
        "threads": threads_used(),
        "bits_equal": bool(bits_equal),
        "a_ms": [t * 1e3 for t in times["a"]],
        "b_ms": [t * 1e3 for t in times["b"]],
        "a_median_ms": statistics.median(times["a"]) * 1e3,
        "b_median_ms": statistics.median(times["b"]) * 1e3,
        "a_min_ms": min(times["a"]) * 1e3,
        "b_min_ms": min(times["b"]) * 1e3,
        "ratio_a_over_b_median": statistics.median(ratios),
        "pairs_above_1": above,
        "pairs_below_1": below,
        "sign_test_p": sign_test_p(above, below),
    }
    print(
        f"{args.target} b{args.batch} ctx {args.context} {args.quantization or 'fp32'}: "
        f"A {switch.labels[0]} {report['a_median_ms']:.3f} ms (min {report['a_min_ms']:.3f}), "
        f"B {switch.labels[1]} {report['b_median_ms']:.3f} ms (min {report['b_min_ms']:.3f}); "
        f"A/B paired median {report['ratio_a_over_b_median']:.3f}, {above} of {len(ratios)} > 1 "
        f"(sign test p {report['sign_test_p']:.3g}); bits {'equal' if bits_equal else 'DIFFER'}"
    )
    if args.out:
        write_report(args.out, report)


if __name__ == "__main__":
    main()
