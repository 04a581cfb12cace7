"""Text and JSON renderings of a plan: every result printed beside the assumption it rests on."""

from __future__ import annotations

from kvserve.lab.plan.arith import kv_bytes_per_sequence, max_concurrent_sequences
from kvserve.lab.plan.planner import Cost, PlanResult


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_num(x: float | None, digits: int = 3) -> str:
    """Three significant figures, thousands separated."""
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if abs(x) >= 10**digits:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def fmt_flops(x: float) -> str:
    return f"{x / 1e12:.3g} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.3g} GFLOP/s"


def fmt_bw(x: float) -> str:
    return f"{x / 1e12:.3g} TB/s" if x >= 1e12 else f"{x / 1e9:.3g} GB/s"


def _bits(x: float | None) -> str:
    return "per-channel" if x is None else f"{x:.3f}"


def model_lines(p: PlanResult) -> list[str]:
    m = p.model
    tie = "tied" if m.tie_word_embeddings else "untied"
    extras = [
        n
        for n, on in (
            ("q/k/v biases", m.qkv_bias),
            ("o bias", m.o_bias),
            ("mlp biases", m.mlp_bias),
            ("q/k norms", m.qk_norm),
        )
        if on
    ]
    head_note = (
        "tied: the embedding table is also the LM head, a matmul"
        if m.tie_word_embeddings
        else f"untied: N minus the {m.num_embedding_params:,} input-embedding parameters, a lookup"
    )
    wd = max(len(row.name) for row in p.formats)
    lines = [
        f"Model  {m.name}" + (f" ({m.source})" if m.source else ""),
        f"  L={m.num_layers} d={m.hidden_size} n_q={m.num_heads} n_kv={m.num_kv_heads} "
        f"d_h={m.head_dim} f={m.intermediate_size} V={m.vocab_size} {tie}, "
        f"max context {m.max_position_embeddings:,}",
        f"  N         {p.num_params:>15,} parameters"
        + (
            f" (includes {', '.join(extras)}, beyond the formula in docs/planning.md)"
            if extras
            else ""
        ),
        f"  N_matmul  {p.num_matmul_params:>15,} ({head_note})",
        "Weights (bits/weight over all parameters, scales and zero-points included)",
        f"  {'format':<{wd}} {'bytes':>10} {'bits/weight':>11} {'linear bits':>12}",
    ]
    for row in p.formats:
        mark = " <- chosen" if row.name == p.weight_format else ""
        lines.append(
            f"  {row.name:<{wd}} {fmt_bytes(row.weight_bytes):>10} {row.bits_per_weight:>11.3f} "
            f"{_bits(row.linear_bits_per_weight):>12}{mark}"
        )
    lines.append(
        "  (a plain int format quantises the block linears only; embeddings, head and norms stay "
        "bf16)"
    )
    return lines


def memory_lines(p: PlanResult) -> list[str]:
    w, a, h = p.workload, p.assumptions, p.hardware
    one = " (one device: one tensor-parallel rank's share)" if p.parallel else ""
    lines = [
        f"KV cache  {p.kv_dtype}: b = {p.kv_bytes_per_value:g} B/value{one}",
        f"  per token    k = 2 L n_kv d_h b = {p.kv_bytes_per_token:,.0f} B",
    ]
    windows = [x for x in p.model.layer_windows if x is not None]
    if not windows:
        lines.append(
            f"  per request  k x ({w.prompt_tokens} prompt + {w.output_tokens} output tokens) = "
            f"{fmt_bytes(p.kv_bytes_per_request)}"
        )
    else:
        # hybrid: window layers hold their window only (kv/groups.py, docs/planning.md)
        b, full = p.kv_bytes_per_value, len(p.model.layer_windows) - len(windows)
        lines.append(
            f"  hybrid       {full} global + {len(windows)} sliding-window layers (window "
            f"{windows[0]:,}): a request holds the window's blocks only in the window layers"
        )
        lines.append(
            f"  per request  {w.prompt_tokens} prompt + {w.output_tokens} output tokens = "
            f"{fmt_bytes(p.kv_bytes_per_request)} (every layer global: "
            f"{fmt_bytes(p.kv_bytes_per_token * w.tokens_per_request)})"
        )
        for context in (8192, 32768):
            if context <= p.model.max_position_embeddings:
                hybrid = kv_bytes_per_sequence(p.model, b, context)
                lines.append(
                    f"  at {context:,} tokens  {fmt_bytes(hybrid)} hybrid vs "
                    f"{fmt_bytes(p.kv_bytes_per_token * context)} full "
                    f"({p.kv_bytes_per_token * context / hybrid:.1f}x); max concurrent "
                    f"{max_concurrent_sequences(p.free_cache_bytes, 0, 0, hybrid):,} vs "
                    f"{max_concurrent_sequences(p.free_cache_bytes, p.kv_bytes_per_token, context):,}"
                )
    lines += [
        f"Memory  {fmt_bytes(h.memory_bytes)} - weights {fmt_bytes(p.weight_bytes)} - overhead "
        f"{fmt_bytes(a.overhead_bytes)} (assumed) = {fmt_bytes(p.free_cache_bytes)} for KV cache",
        f"  max concurrent full-length requests  {p.max_concurrent:,}",
    ]
    if w.shared_prefix_tokens:
        lines.append(
            f"  ... with the {w.shared_prefix_tokens}-token shared prefix stored once  "
            f"{p.max_concurrent_shared_prefix:,}"
        )
    return lines


def hardware_lines(p: PlanResult) -> list[str]:
    h, a = p.hardware, p.assumptions
    kind = "measured" if h.measured else "datasheet"
    return [
        f"Hardware  {h.name}: {fmt_bytes(h.memory_bytes)}, "
        f"{fmt_bw(h.bandwidth_bytes_per_s)} {kind} (x {a.bandwidth_fraction:g} assumed achievable "
        f"= {fmt_bw(p.bandwidth_bytes_per_s)}), "
        f"{fmt_flops(h.peak_flops_per_s)} {h.compute_dtype}",
        f"  source: {h.source}",
    ]


def _row(label: str, value: str, note: str = "") -> str:
    return f"  {label:<20} {value:>10}  {note}".rstrip()


def latency_lines(p: PlanResult) -> list[str]:
    lat, w, a, i = p.latency, p.workload, p.assumptions, p.intensity
    n_prompt, n_shared = w.prompt_tokens, w.shared_prefix_tokens
    peak = fmt_flops(p.hardware.peak_flops_per_s)
    lines = [
        "Latency (one request alone unless a batch is named)",
        _row(
            "TTFT cold",
            fmt_s(lat.ttft_cold_s),
            f"prefill {n_prompt} tokens / (MFU {a.mfu:g} x {peak}), at least one weight read"
            + (" + all-reduces" if p.parallel else ""),
        ),
        _row(
            "TTFT cached prefix",
            fmt_s(lat.ttft_cached_s),
            f"{n_shared} tokens cached, {n_prompt - n_shared} computed",
        ),
        _row(
            "TPOT solo",
            fmt_s(lat.tpot_solo_s),
            f"= {fmt_num(lat.tokens_per_s_solo)} tokens/s, {lat.solo_bound}-bound at mean context "
            f"{w.mean_decode_context:g}; estimated MBU {lat.estimated_mbu_solo:.0%}",
        ),
        _row("E2E solo", fmt_s(lat.e2e_solo_s), f"TTFT + {w.output_tokens - 1} x TPOT"),
    ]
    if lat.tpot_max_batch_s is not None:
        lines.append(
            _row(
                f"TPOT at B={p.max_concurrent:,}",
                fmt_s(lat.tpot_max_batch_s),
                f"= {fmt_num(lat.per_sequence_tokens_per_s_max_batch)} tokens/s per sequence, "
                f"{fmt_num(lat.tokens_per_s_max_batch)} tokens/s aggregate, "
                f"{lat.max_batch_bound}-bound",
            )
        )
    lines += [
        _row(
            "decode limit",
            fmt_num(lat.aggregate_limit_tokens_per_s),
            "tokens/s aggregate as B grows: BW / (k t)",
        ),
        "Arithmetic intensity (FLOP/byte)",
        _row("ridge peak / BW", fmt_num(i.ridge), "below it a kernel is memory-bound"),
        _row("prefill", fmt_num(i.prefill), f"{n_prompt} tokens over weights + KV written"),
        _row("decode B=1", fmt_num(i.decode_solo)),
        _row("decode B=max", fmt_num(i.decode_max_batch)),
        _row("weight GEMV", fmt_num(i.weights_gemv), "2 / bytes per linear weight"),
        _row("decode attention", fmt_num(i.attention_decode), "2 n_q / (n_kv b), any batch"),
    ]
    return lines


def load_lines(p: PlanResult) -> list[str]:
    if p.load is None or p.cost is None or p.little is None:
        return ["Full load, cost, Little's law: not computed (no full-length request fits)"]
    load, c, li, w = p.load, p.cost, p.little, p.workload
    per_m = "-" if c.usd_per_million_output is None else f"${c.usd_per_million_output:.4g}"
    per_m_full = (
        "-"
        if c.usd_per_million_output_full_load is None
        else f"${c.usd_per_million_output_full_load:.4g}"
    )
    price = "-" if c.usd_per_hour is None else f"${c.usd_per_hour:.4g}/h"
    return [
        f"Full load (B={p.max_concurrent:,} decoding; prefills batched in between, compute-bound; "
        f"{'shared prefix cached' if w.shared_prefix_tokens else 'no prefix cache'})",
        f"  {fmt_s(load.device_s_per_request)} device time per request -> "
        f"{fmt_num(load.requests_per_s)} requests/s, "
        f"{fmt_num(load.output_tokens_per_s)} output tokens/s; "
        f"prefill {load.prefill_share:.0%} of the time",
        f"Cost  {price} ({c.price_source})",
        f"  {w.requests_per_day:,.0f} requests/day -> busy {c.busy_hours_per_day:.3g} h/day; "
        f"{_replicas(c)}; utilisation {c.utilisation:.1%} ({c.utilisation_source})",
        f"  per million output tokens  {per_m} at {c.utilisation:.1%} utilisation, {per_m_full} at "
        "100%",
        f"Little's law (per {'replica' if c.devices_per_replica > 1 else 'device'}, at the stated "
        "volume)",
        f"  no queueing:  {li.arrival_rate_per_s:.4g} requests/s x E2E {fmt_s(li.e2e_s)} = "
        f"{li.mean_in_system:.3g} in system",
        f"  M/M/1 at rho {li.utilisation:.1%}: E2E / (1 - rho) = {fmt_s(li.e2e_mm1_s)} -> "
        f"{fmt_num(li.mean_in_system_mm1)} in system (max concurrent {li.max_concurrent:,}): "
        f"{'OK' if li.stable else 'DOES NOT FIT'}",
    ]


def _replicas(c: Cost) -> str:
    if c.devices_per_replica == 1:
        return f"{c.num_devices} device(s)"
    return f"{c.num_devices} replica(s) x {c.devices_per_replica} devices"


def parallel_lines(p: PlanResult) -> list[str]:
    """Tensor / data parallelism: what one device holds and what its all-reduces cost."""
    par = p.parallel
    if par is None:
        return []
    m, n, link = p.model, par.tensor_parallel, par.interconnect
    lat = p.latency
    kv_note = (
        f"{m.num_kv_heads} KV heads < {n} ranks: each rank holds 1, replicated {n // m.num_kv_heads}x"
        if par.kv_heads_replicated
        else f"{m.num_kv_heads} KV heads / {n} = {par.num_kv_heads_per_rank} per rank"
    )
    big = fmt_s(par.decode_comm_s_max_batch)
    totals = (
        f"  all {par.data_parallel} replica(s)  max concurrent {par.max_concurrent_total:,}; "
        f"{fmt_num(par.tokens_per_s_max_batch_total)} tokens/s at max batch; full load "
        f"{fmt_num(par.full_load_output_tokens_per_s_total)} output tokens/s"
    )
    if n == 1:
        return [
            f"Parallel  data parallel {par.data_parallel} replicas of one device each: no "
            "communication; capacity adds, latency does not improve",
            totals,
        ]
    return [
        f"Parallel  tensor parallel {n} x data parallel {par.data_parallel} = {par.num_devices} "
        f"devices; interconnect {link.name}: {fmt_bw(link.bandwidth_bytes_per_s)} each way, "
        f"{link.latency_s * 1e6:g} us per ring step",
        f"  source: {link.source}",
        f"  weights per device  {fmt_bytes(par.weight_bytes_per_device)} of "
        f"{fmt_bytes(par.weight_bytes_total)} (norms replicated)",
        f"  KV per token        {par.kv_bytes_per_token_per_device:,.0f} B per device of "
        f"{par.kv_bytes_per_token_total:,.0f} B ({kv_note})",
        f"  all-reduce per layer per token  2 x 2 (N-1)/N x d x b = 2 x 2 x {n - 1}/{n} x "
        f"{m.hidden_size} x {par.activation_bytes:g} = {par.allreduce_bytes_per_layer_per_token:,.0f}"
        " B per rank",
        f"  per decode token  {par.comm_bytes_per_decode_token:,.0f} B per rank "
        f"({2 * m.num_layers} layer all-reduces + 1 after the embedding + the logits gather); "
        f"{par.num_allreduces_per_step} all-reduces a step, each 2 (N-1)/N x M / BW + 2 (N-1) x "
        "latency, not overlapped",
        f"  communication  TPOT solo {fmt_s(par.decode_comm_s_solo)} "
        f"({par.decode_comm_share_solo:.0%} of {fmt_s(lat.tpot_solo_s)}), at B={p.max_concurrent:,} "
        f"{big}, prefill of {p.workload.prompt_tokens} tokens {fmt_s(par.prefill_comm_s)}",
        totals,
    ]


def assumption_lines(p: PlanResult) -> list[str]:
    a, w = p.assumptions, p.workload
    return [
        "Assumptions",
        f"  workload: {w.prompt_tokens} prompt tokens ({w.shared_prefix_tokens} shared), "
        f"{w.output_tokens} output tokens, {w.requests_per_day:,.0f} requests/day",
        f"  prefill MFU {a.mfu:g}; bandwidth {a.bandwidth_fraction:g} x peak; runtime overhead "
        f"{fmt_bytes(a.overhead_bytes)}; decode compute at peak FLOP/s (docs/planning.md)",
        "  decode step = max((W + B k t) / BW, (2 N_matmul B + 4 L d B t) / peak), t = prompt + "
        "output / 2"
        + (" (one rank's W, k, N_matmul, d) + the step's all-reduces" if p.parallel else ""),
    ]


def render_text(p: PlanResult) -> str:
    title = (
        f"kvserve plan: {p.model.name} on {p.hardware.name}, weights {p.weight_format}, "
        f"KV cache {p.kv_dtype}"
    )
    if p.parallel is not None:
        par = p.parallel
        title = title.replace(
            f" on {p.hardware.name},",
            f" on {par.num_devices} x {p.hardware.name} (TP {par.tensor_parallel} x DP "
            f"{par.data_parallel}),",
        )
    sections: list[list[str]] = [
        model_lines(p),
        memory_lines(p),
        parallel_lines(p),
        hardware_lines(p),
        latency_lines(p),
        load_lines(p),
        assumption_lines(p),
    ]
    if p.notes:
        sections.append(["Notes"] + [f"  ! {n}" for n in p.notes])
    body = ["\n".join(s) + "\n" for s in sections if s]
    return "\n".join([title, ""] + body).rstrip() + "\n"


COMPARE_COLUMNS = (
    "hardware",
    "memory",
    "BW",
    "x BW",
    "peak",
    "ridge",
    "max conc",
    "TTFT",
    "TPOT B=1",
    "tok/s B=max",
    "full-load tok/s",
    "prefill %",
    "$/h",
    "$/M tok @100%",
)


def compare_row(p: PlanResult) -> dict[str, object]:
    lat, load, cost = p.latency, p.load, p.cost
    return {
        "hardware": p.hardware.name,
        "memory_bytes": p.hardware.memory_bytes,
        "bandwidth_bytes_per_s": p.hardware.bandwidth_bytes_per_s,
        "peak_flops_per_s": p.hardware.peak_flops_per_s,
        "ridge_flops_per_byte": p.intensity.ridge,
        "max_concurrent": p.max_concurrent,
        "ttft_cold_s": lat.ttft_cold_s,
        "tpot_solo_s": lat.tpot_solo_s,
        "tokens_per_s_max_batch": lat.tokens_per_s_max_batch,
        "full_load_output_tokens_per_s": load.output_tokens_per_s if load else None,
        "prefill_share": load.prefill_share if load else None,
        "usd_per_hour": cost.usd_per_hour if cost else None,
        "usd_per_million_output_full_load": cost.usd_per_million_output_full_load if cost else None,
    }


def render_compare(plans: list[PlanResult]) -> str:
    cells = []
    for p in plans:
        r = compare_row(p)
        share = r["prefill_share"]
        usd_h, per_m = r["usd_per_hour"], r["usd_per_million_output_full_load"]
        cells.append(
            (
                str(r["hardware"]),
                fmt_bytes(p.hardware.memory_bytes),
                fmt_bw(p.hardware.bandwidth_bytes_per_s),
                f"{p.assumptions.bandwidth_fraction:g}",
                fmt_flops(p.hardware.peak_flops_per_s),
                fmt_num(p.intensity.ridge),
                f"{p.max_concurrent:,}",
                fmt_s(p.latency.ttft_cold_s),
                fmt_s(p.latency.tpot_solo_s),
                fmt_num(p.latency.tokens_per_s_max_batch),
                fmt_num(r["full_load_output_tokens_per_s"]),  # type: ignore[arg-type]
                "-" if share is None else f"{share:.0%}",
                "-" if usd_h is None else f"{usd_h:.3g}",
                "-" if per_m is None else f"{per_m:.3g}",
            )
        )
    widths = [max(len(h), *(len(c[j]) for c in cells)) for j, h in enumerate(COMPARE_COLUMNS)]
    lines = [
        "  ".join(
            h.rjust(wd) if j else h.ljust(wd)
            for j, (h, wd) in enumerate(zip(COMPARE_COLUMNS, widths, strict=True))
        )
    ]
    for c in cells:
        lines.append(
            "  ".join(
                x.rjust(wd) if j else x.ljust(wd)
                for j, (x, wd) in enumerate(zip(c, widths, strict=True))
            )
        )
    p = plans[0]
    w, a = p.workload, p.assumptions
    lines.append(
        f"({p.model.name}, weights {p.weight_format}, KV {p.kv_dtype}; {w.prompt_tokens} prompt "
        f"+ {w.output_tokens} output tokens; MFU {a.mfu:g}; 'x BW' = fraction of the bandwidth "
        "assumed achievable; prices are each profile's illustrative reference)"
    )
    return "\n".join(lines) + "\n"
