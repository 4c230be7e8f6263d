"""Summary tables (markdown) and plots (PNG) of a sweep's runs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks.netbench.metrics import CPU_COPY_NOTE, HEADER_BYTES, median


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)) else f"{seconds * 1e3:.1f}"


def _kb(num: float | None) -> str:
    return "-" if num is None else f"{num / 1e3:.1f}"


def _fixed(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _agree(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "NO"


def _ratio(values: list[float]) -> str:
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"{low:.3f}" if abs(high - low) < 5e-4 else f"{low:.3f}-{high:.3f}"


def _rule(header: str) -> str:
    return "|" + "|".join(["---"] * (header.count("|") - 1)) + "|"


def summary_table(summaries: list[dict]) -> str:
    header = ("| env | config | tok/s decode | tok/s e2e | step median ms | step p90 ms | KB/step (process) | KB/step (iface) "
              "| iface/process per hop | agree | raw/wire | compute ms | transport ms | wire ms | floor ms | measured/floor |")
    lines = [header, _rule(header)]
    for s in summaries:
        lines.append(
            f"| {s['env']} | {s['config']} | {s['decode_tokens_per_s']:.1f} | {s['e2e_tokens_per_s']:.1f} "
            f"| {_ms(s['step_median_s'])} | {_ms(s['step_p90_s'])} | {_kb(s['step_wire_bytes'])} | {_kb(s['step_iface_bytes'])} "
            f"| {_ratio(s['iface_over_app'])} | {_agree(s['counters_agree'])} | {_fixed(s['compression_ratio'], 3)} | {_ms(s['compute_s'])} | {_ms(s['transport_s'])} "
            f"| {_ms(s['wire_s'])} "
            f"| {_ms(s['floor_s'])} | {_fixed(s['measured_over_floor'])} |")
    return "\n".join(lines)


def comparison_table(summaries: list[dict], reference: str = "baseline") -> str:
    """Each configuration against `reference`, per environment: throughput, transport, bytes, measured/floor."""
    by_key = {(s["env"], s["config"]): s for s in summaries}
    others = [c for c in dict.fromkeys(s["config"] for s in summaries) if c != reference]
    if not others or not any(s["config"] == reference for s in summaries):
        return ""
    header = ("| env | config | tok/s (vs " + reference + ") | speed-up | transport ms (vs " + reference + ") "
              "| KB/step (vs " + reference + ") | measured/floor " + reference + " | measured/floor config |")
    lines = [header, _rule(header)]
    for env in dict.fromkeys(s["env"] for s in summaries):
        base = by_key.get((env, reference))
        for config in others:
            run = by_key.get((env, config))
            if base is None or run is None:
                continue
            lines.append(
                f"| {env} | {config} | {run['decode_tokens_per_s']:.1f} ({base['decode_tokens_per_s']:.1f}) "
                f"| {run['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x "
                f"| {_ms(run['transport_s'])} ({_ms(base['transport_s'])}) "
                f"| {_kb(run['step_wire_bytes'])} ({_kb(base['step_wire_bytes'])}) "
                f"| {_fixed(base['measured_over_floor'])} | {_fixed(run['measured_over_floor'])} |")
    return "\n".join(lines)


def paired_ratio(run: dict, other: dict) -> list[float]:
    """`run`'s end-to-end tokens/s over `other`'s, repeat by repeat: the two ran in the same round, within a minute
    or two of each other, so a slow phase of the machine slows both."""
    return [mine / theirs for mine, theirs in zip(run["e2e_tokens_per_s_repeats"], other["e2e_tokens_per_s_repeats"])]


def auto_table(summaries: list[dict], auto: str = "auto", off: str = "baseline") -> str:
    """Per environment: the best configuration by median end-to-end tokens/s over repeats, and `auto` against it and
    against `off`, as the median of their repeat-by-repeat ratios (with the range)."""
    by_key = {(s["env"], s["config"]): s for s in summaries if s.get("e2e_tokens_per_s_repeats")}
    header = ("| env | auto tok/s (median) | best configuration | its tok/s (median) | auto / best, paired: median (range) "
              f"| auto / {off}, paired: median (range) |")
    lines = [header, _rule(header)]
    for env in dict.fromkeys(s["env"] for s in summaries):
        runs = {config: run for (e, config), run in by_key.items() if e == env}
        if auto not in runs:
            continue
        best = max(runs, key=lambda config: median(runs[config]["e2e_tokens_per_s_repeats"]))
        cells = [env, f"{median(runs[auto]['e2e_tokens_per_s_repeats']):.1f}", best,
                 f"{median(runs[best]['e2e_tokens_per_s_repeats']):.1f}"]
        for other in (best, off):
            ratios = paired_ratio(runs[auto], runs[other]) if other in runs else []
            cells.append(f"{median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speculation_table(summaries: list[dict]) -> str:
    """The configurations that ran through `model.generate`: tokens/s beside how the speculation went."""
    header = ("| env | config | tok/s decode | tok/s e2e | steps through the chain | token trees | plain steps "
              "| tokens per step (per row) | tokens per token tree (per row) |")
    lines = [header, _rule(header)]
    for s in summaries:
        if s.get("mode") == "generate":
            lines.append(f"| {s['env']} | {s['config']} | {s['decode_tokens_per_s']:.1f} | {s['e2e_tokens_per_s']:.1f} "
                         f"| {s['decode_steps']} | {s['tree_rounds']} | {s['plain_rounds']} | {_fixed(s['tokens_per_step'])} "
                         f"| {_fixed(s['tokens_per_tree_round'])} |")
    return "\n".join(lines)


def breakdown_table(summaries: list[dict]) -> str:
    header = ("| env | config | hop | rate Mbps | KB (iface) | T d2h ms | T encode+send ms | T wire ms (of which at rate) "
              "| T recv+decode ms | T h2d ms | compute ms (receiver) |")
    lines = [header, _rule(header)]
    for s in summaries:
        for row in (s["breakdown"] or {}).get("hops", []):
            rate = "unshaped" if row["rate_mbps"] is None else f"{row['rate_mbps']:g}"
            compute = "-" if row["compute_s"] is None else f"{_ms(row['compute_s'])} ({row['computed_by']})"
            lines.append(f"| {s['env']} | {s['config']} | {row['hop']} | {rate} | {_kb(row['bytes'])} | {_ms(row['d2h_s'])} "
                         f"| {_ms(row['encode_s'])} | {_ms(row['wire_s'])} ({_ms(row['serialization_s'])}) | {_ms(row['decode_s'])} "
                         f"| {_ms(row['h2d_s'])} | {compute} |")
    return "\n".join(lines)


COLUMNS = (
    "Columns: one step = one decode step of the whole batch, medians over every decode step of every repeat. "
    "`tok/s decode` = batch x decode steps / their wall time (client embeddings and LM head included); `tok/s e2e` "
    "includes the prefill. `KB/step (process)` = bytes of all hops of one decode step as the processes count them "
    "(encoded tensor frames); `KB/step (iface)` = the hops' senders' uplink tx bytes per decode step, less the idle "
    "swarm's background (DHT upkeep, measured for a few seconds before the runs); `iface/process` = the interface "
    f"bytes less {HEADER_BYTES} header bytes per packet, over the process's bytes, per hop (the rest is message "
    "headers, libp2p framing and the servers' small per-step acks); `agree` = every hop within -3 % / +5 % + 1.5 KB "
    "of the process's count. `transport` = chain time less compute "
    "(encode + wire + decode of all hops): the part the optimisations act on, and less exposed to the CPU load of "
    "this shared machine than the step time. `wire` = chain time less encode, decode and compute. `floor` = compute "
    "of the blocks + every hop's interface bytes at its shaped rate (unshaped hops count 0); `measured/floor` = "
    f"median chain time (client encode to client decode) / floor. {CPU_COPY_NOTE}."
)
AUTO_NOTE = ("Every configuration ran once per round, the rounds one after another; a ratio is taken within a round "
             "(auto's run over the other configuration's run in the same round), and the median over the rounds is "
             "given with their range. The best configuration is the one with the highest median tokens/s.")
SPECULATION_NOTE = ("A configuration with `speculative` runs `model.generate` with the model's draft, as the product "
                    "speculates, instead of the step loop: its tok/s are measured alike (decode: after the first token; "
                    "e2e: the whole generation), a step is one trip through the chain (a token tree or a plain step, "
                    "mean time per generation), and the per-hop figures of the step loop (bytes, breakdown, floor, "
                    "planner predictions) are not measured for it (`-`).")
BREAKDOWN_NOTE = ("T wire = step time left after encode, decode and compute, per hop: its bytes at the shaped rate "
                  "(in brackets) plus an equal share of the remaining stack overhead.")


def describe(meta: dict) -> list[str]:
    machine = meta["machine"]
    servers = ", ".join(f"{node} {start}:{end}" for node, (start, end) in zip(meta["server_nodes"], meta["ranges"]))
    dtype = meta.get("dtype_resolved", meta["dtype"])
    retried = sum(s.get("failed_attempts", 0) for s in meta.get("_summaries", []))
    return [
        *([f"**INCOMPLETE**: the sweep stopped early: {meta['incomplete']}", ""] if meta.get("incomplete") else []),
        *([f"{retried} run(s) failed once and were run again (see failed_attempts in runs/*.json).", ""] if retried else []),
        f"Reproduce (as root, from the repository root): `{meta['command']}`",
        "",
        (f"Model: {meta['model_name']} ({meta['model_note']}); hidden {meta['hidden_size']}, {meta['num_blocks']} blocks, "
         f"dtype {dtype}. Servers: {servers}. Batch {meta['batch']}, prompt {meta['prompt_len']} tokens, "
         f"{meta['new_tokens']} new tokens (1 prefill + {meta['new_tokens'] - 1} decode steps), {meta.get('repeats', 1)} "
         f"repeat(s); before each run a warm-up session (1-token prompt, {meta['warmup_steps']} decode steps)"
         + (f"; before the measured rounds of each environment, an unrecorded round of {meta['warmup_round_tokens']} "
            "tokens per configuration." if meta.get("warmup_round_tokens") else ".")),
        (f"Machine: {machine['cpus']} CPUs (shared), load average {machine['loadavg_start']} at the start, "
         f"{machine.get('loadavg_end', '?')} at the end; kernel {machine['kernel']}; git {machine['git']}; {meta['started']}."),
    ]


def write_markdown(path: Path, meta: dict, summaries: list[dict]) -> None:
    lines = [f"# netbench sweep: {meta['model_name']}", "", *describe({**meta, "_summaries": summaries}), "", COLUMNS, "",
             summary_table(summaries), ""]
    comparison = comparison_table(summaries)
    if comparison:
        lines += ["## Against the baseline", "", comparison, ""]
    if any(s.get("mode") == "generate" for s in summaries):
        lines += ["## Speculative decoding (model.generate with the draft model)", "", SPECULATION_NOTE, "",
                  speculation_table(summaries), ""]
    if any(s["config"] == "auto" for s in summaries):
        lines += ["## auto against the best configuration and against off (end-to-end tokens/s, prefill included)", "",
                  AUTO_NOTE, "", auto_table(summaries), ""]
    lines += ["## Transport breakdown (median decode step)", "", BREAKDOWN_NOTE, "",
              breakdown_table(summaries), "",
              "## The planner's prediction against the measurement (median chain time; ratio = predicted / measured)", "",
              prediction_table(summaries), ""]
    path.write_text("\n".join(lines))


def plot_grouped(path: Path, summaries: list[dict], title: str, value, ylabel: str, fmt: str = "%.0f") -> None:
    """Bars per environment, one per configuration (the paper's figures 8, 10, 11)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = list(dict.fromkeys(s["env"] for s in summaries))
    configs = list(dict.fromkeys(s["config"] for s in summaries))
    by_key = {(s["env"], s["config"]): s for s in summaries}
    width = 0.8 / max(len(configs), 1)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(envs), 4.2))
    for index, config in enumerate(configs):
        xs, ys = [], []
        for position, env in enumerate(envs):
            if (env, config) in by_key:
                xs.append(position + (index - (len(configs) - 1) / 2) * width)
                ys.append(value(by_key[(env, config)]))
        bars = ax.bar(xs, ys, width, label=config)
        ax.bar_label(bars, fmt=fmt, fontsize=7)
    ax.set_xticks(range(len(envs)), envs)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_throughput(path: Path, summaries: list[dict], title: str) -> None:
    plot_grouped(path, summaries, title, lambda s: s["decode_tokens_per_s"], "decode throughput (tokens/s)")


def plot_transport(path: Path, summaries: list[dict], title: str) -> None:
    shown = [s for s in summaries if s["transport_s"] is not None]  # runs through generate() have no transport figure
    if shown:
        plot_grouped(path, shown, title + " - transport = step less compute", lambda s: s["transport_s"] * 1e3,
                     "transport per decode step (ms)")


def plot_breakdown(path: Path, summaries: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = [s for s in summaries if s["breakdown"] is not None]
    if not summaries:
        return
    labels = [f"{s['env']}\n{s['config']}" for s in summaries]
    parts = {
        "compute (blocks)": [s["breakdown"]["compute_total_s"] for s in summaries],
        "encode + send": [s["breakdown"]["encode_total_s"] for s in summaries],
        "receive + decode": [s["breakdown"]["decode_total_s"] for s in summaries],
        "wire: bytes at the shaped rate": [sum(r["serialization_s"] for r in s["breakdown"]["hops"]) for s in summaries],
        "wire: stack overhead": [s["breakdown"]["stack_overhead_s"] for s in summaries],
    }
    fig, ax = plt.subplots(figsize=(1.5 + 0.75 * len(summaries), 4.6))
    bottom = [0.0] * len(summaries)
    for name, values in parts.items():
        ms = [v * 1e3 for v in values]
        ax.bar(range(len(summaries)), ms, 0.7, bottom=bottom, label=name)
        bottom = [b + m for b, m in zip(bottom, ms)]
    ax.scatter(range(len(summaries)), [s["floor_s"] * 1e3 for s in summaries], marker="_", s=300, color="black", zorder=3,
               label="floor")
    ax.set_xticks(range(len(summaries)), labels, fontsize=7)
    ax.set_ylabel("median decode step (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timelines(path: Path, summaries: list[dict], title: str) -> None:
    """One decode step per configuration (the one closest to the median), per environment: who computes,
    encodes, decodes and sends which micro-batch when."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [s for s in summaries if s.get("timeline")]
    if not shown:
        return
    colours = {"decode": "tab:green", "compute": "tab:blue", "encode": "tab:orange", "transfer": "tab:gray"}
    fig, axes = plt.subplots(len(shown), 1, figsize=(11, 1.0 + 2.1 * len(shown)), squeeze=False)
    for ax, summary in zip(axes[:, 0], shown):
        rows = list(dict.fromkeys(item["row"] for item in summary["timeline"]))
        for item in summary["timeline"]:
            ax.barh(rows.index(item["row"]), item["end"] - item["start"], left=item["start"], height=0.7,
                    color=colours[item["kind"]], alpha=0.55 + 0.45 * (item["mb"] % 2), edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(rows)), rows, fontsize=6)
        ax.invert_yaxis()
        predicted = (summary.get("predicted") or {}).get("decode", {})
        label = f"{summary['env']} {summary['config']}: M={summary['micro_batches']}, step {summary['timeline_chain_s'] * 1e3:.0f} ms"
        if predicted:
            label += f" (planner: simulated {predicted['simulated_s'] * 1e3:.0f}, closed form {predicted['closed_form_s'] * 1e3:.0f} ms)"
        ax.set_title(label, fontsize=8)
    axes[-1, 0].set_xlabel("ms from the client's first send (bars alternate shade per micro-batch)")
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()], labels=list(colours),
               loc="upper right", fontsize=7, ncol=4)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def prediction_table(summaries: list[dict]) -> str:
    """The planner's predicted chain time beside the measured one, decode and prefill steps."""
    header = "| env | config | M | decode measured ms | simulated ms (ratio) | closed form ms (ratio) | prefill measured ms | simulated ms (ratio) | closed form ms (ratio) |"
    lines = [header, _rule(header)]
    for s in summaries:
        cells = [s["env"], s["config"], ",".join(map(str, s.get("micro_batches", [])))]
        for kind in ("decode", "prefill"):
            p = (s.get("predicted") or {}).get(kind)
            if not p:
                cells += ["-", "-", "-"]
                continue
            cells += [_ms(p["measured_s"])] + [f"{_ms(p[key])} ({p[key] / p['measured_s']:.2f})"
                                                for key in ("simulated_s", "closed_form_s")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_sweep_outputs(out_dir: Path, meta: dict, summaries: list[dict], plots: bool = True) -> dict[str, str]:
    """summary.md, summary.json and (with matplotlib) throughput.png, transport.png, breakdown.png in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_markdown(out_dir / "summary.md", meta, summaries)
    (out_dir / "summary.json").write_text(json.dumps(clean_json({"meta": meta, "runs": summaries}), indent=1))
    paths = {"summary_md": str(out_dir / "summary.md"), "summary_json": str(out_dir / "summary.json")}
    if plots and summaries:
        title = f"{meta['model_name']}: B={meta['batch']}, {len(meta['ranges'])} servers, {meta.get('dtype_resolved', meta['dtype'])}"
        try:
            plot_throughput(out_dir / "throughput.png", summaries, title)
            plot_breakdown(out_dir / "breakdown.png", summaries, title)
            plot_transport(out_dir / "transport.png", summaries, title)
            for env in dict.fromkeys(summary["env"] for summary in summaries):
                plot_timelines(out_dir / f"timeline-{env}.png", [x for x in summaries if x["env"] == env], f"{title}, {env}")
            paths.update(throughput_png=str(out_dir / "throughput.png"), breakdown_png=str(out_dir / "breakdown.png"),
                         transport_png=str(out_dir / "transport.png"))
        except ImportError:
            pass  # no matplotlib: tables only
    return paths


def clean_json(value: Any) -> Any:
    """NaN and infinities become null, so the files are strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: clean_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(item) for item in value]
    return value
