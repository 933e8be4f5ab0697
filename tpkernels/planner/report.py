"""Human and machine output of a plan: the ranked table, why the winner wins, --explain."""

from __future__ import annotations

from tpkernels.parallel.config import MOE_CHUNKS_DEFAULT
from tpkernels.planner.efficiency import is_calibrated
from tpkernels.planner.estimate import Estimate
from tpkernels.planner.memory import GIB
from tpkernels.planner.search import Explanation, Plan

COMPONENTS = {
    "gemm": "GEMM compute", "elementwise": "memory-bound kernels", "tp_exposed": "exposed TP communication",
    "cp_exposed": "exposed context-parallel K/V exchange",
    "ep_exposed": "exposed expert-parallel all-to-all", "p2p": "pipeline send/recv", "bubble": "pipeline bubble", "dp_exposed": "exposed DP gradient reduction",
    "optimizer": "optimizer step", "overhead": "fixed per-step overhead (measured here)",
    "reference": "DPO reference forward pass (online)",
}


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def describe_inputs(p: Plan) -> list[str]:
    t = p.train
    tune = {"lora": f"LoRA r={t.lora_rank}", "qlora": f"QLoRA {t.quant} r={t.lora_rank}"}.get(t.finetune,
                                                                                               "full fine-tune")
    e = p.efficiency
    lines = [
        f"model    {p.model.describe()}",
        f"cluster  {p.cluster.describe()}",
        f"training global batch {t.global_batch} × {t.seq_length} tokens, {t.precision}, {t.optimizer}, {tune}"
        + ("" if t.flash_attention else ", no FlashAttention")
        + ("" if t.task == "pretrain" else f", {t.task}" + (f" (reference: {t.dpo_reference})" if t.task == "dpo"
                                                             else "")),
        f"constants gemm {e.gemm:.2f} (fp8 {e.gemm_fp8:.2f}, k0 {e.gemm_k0:g}, tail {e.gemm_tail:g}, "
        f"+{1e6 * e.gemm_launch_s:g} µs per GEMM), attention {e.attention:.2f}, hbm {e.hbm:.2f}, link {e.link:.2f}, "
        f"tp_overlap {e.tp_overlap:g}" + ("" if is_calibrated(p.cluster.gpu) else
                                        f" (no published {p.cluster.gpu.generation} runs: Ampere's constants)"),
    ]
    if p.model.is_moe:
        chunks = p.fixed.get("moe_chunks", MOE_CHUNKS_DEFAULT)  # ParallelConfig.moe_chunks of every candidate
        cap = (f"capacity factor {p.model.capacity_factor:g}" if p.model.capacity_factor is not None
               else f"dropless, dispatch buffers sized at {t.moe_peak_imbalance:g}× the balanced share")
        lines.append(f"experts  routing imbalance {t.moe_imbalance:g}× in the step time, {cap}; all-to-all in "
                     f"{chunks} chunk{'s' if chunks > 1 else ''}")
    if p.fixed:
        lines.append("fixed    " + ", ".join(f"{k}={v}" for k, v in p.fixed.items()))
    return lines


def label(e: Estimate) -> str:
    """The layout and, with a pipeline, its schedule: ``TP4 PP8 DP2 mbs1 SP ZeRO1 zb-h1``."""
    return e.config.short() + (f" {e.time.schedule}" if e.config.pp > 1 else "")


def table(rows: list[Estimate]) -> str:
    head = ("#", "layout", "schedule", "v", "mbs", "m", "SP", "recompute", "ZeRO1", "memory GiB", "step s", "MFU",
            "TFLOP/s/GPU", "bubble", "TP exposed", "DP exposed", "comm/comp")
    body = []
    for i, e in enumerate(rows, 1):
        c, t = e.config, e.time
        body.append((
            str(i), f"TP{c.tp} " + (f"CP{c.cp}" + ("" if c.cp_algo == "ring" else f"-{c.cp_algo}") + " "
                                    if c.cp > 1 else "") + f"PP{c.pp} DP{c.dp}" + (f" EP{c.ep}" if c.ep > 1 else ""),
            t.schedule, str(c.virtual_stages), str(c.micro_batch_size),
            str(c.num_microbatches), "on" if c.sequence_parallel else "off", c.recompute, "on" if c.zero1 else "off",
            f"{e.memory.total / GIB:.1f}/{e.memory_capacity_gib:.3g}", f"{e.step_time:.3g}", _pct(e.mfu),
            f"{e.model_tflops_per_gpu:.0f}", _pct(t.bubble / t.total), _pct(t.tp_exposed / t.total),
            _pct(t.dp_exposed / t.total), _pct(t.comm_ratio),
        ))
    if any(e.config.cp > 1 for e in rows):  # the K/V exchange, beside TP's and DP's
        head = head[:15] + ("CP exposed",) + head[15:]
        body = [r[:15] + (_pct(e.time.cp_exposed / e.time.total),) + r[15:] for r, e in zip(body, rows)]
    if any(e.time.ep_comm > 0 for e in rows):  # the experts' all-to-all, before DP's
        at = head.index("DP exposed")
        head = head[:at] + ("EP exposed",) + head[at:]
        body = [r[:at] + (_pct(e.time.ep_exposed / e.time.total),) + r[at:] for r, e in zip(body, rows)]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = lambda r: "  ".join(x.rjust(w) if j not in (1, 2, 7) else x.ljust(w) for j, (x, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, body)])


def compare(a: Estimate, b: Estimate) -> str:
    """Why ``a`` beats ``b``: the components where b spends more time, and what b does better."""
    ta, tb = a.time.as_dict(), b.time.as_dict()
    deltas = sorted(((tb[k] - ta[k], k) for k in COMPONENTS), reverse=True)
    worse = [f"{COMPONENTS[k]} +{d:.3g} s" for d, k in deltas if d > 0.02 * a.step_time][:2]
    better = [f"{COMPONENTS[k]} −{-d:.3g} s" for d, k in reversed(deltas) if -d > 0.02 * a.step_time][:1]
    slower = b.step_time / a.step_time - 1
    text = f"{label(b)} takes {100 * slower:.1f}% longer per step"
    if worse:
        text += f" ({', '.join(worse)})"
    if better:
        text += f", although it saves {better[0].replace('−', '')}"
    mem_a, mem_b = a.memory.total / GIB, b.memory.total / GIB
    if abs(mem_b - mem_a) > 1:
        text += f"; it needs {mem_b:.1f} GiB per GPU against {mem_a:.1f}"
    return text + "."


def why(a: Estimate) -> str:
    t = a.time
    parts = [f"{_pct(t.compute / t.total)} of its step is compute"]
    if a.config.tp > 1:
        hidden = 1 - t.tp_exposed / t.tp_comm if t.tp_comm else 0
        parts.append(f"TP{a.config.tp} stays inside a node and {_pct(hidden)} of its communication is hidden")
    if a.config.cp > 1:
        hidden = 1 - t.cp_exposed / t.cp_comm if t.cp_comm else 0
        parts.append(f"CP{a.config.cp} ({a.config.cp_algo}) splits each sequence over {a.config.cp} GPUs, dividing "
                     f"the activations by {a.config.cp}, and {_pct(hidden)} of its K/V exchange is hidden")
    if a.config.ep > 1:
        hidden = 1 - t.ep_exposed / t.ep_comm if t.ep_comm else 0
        parts.append(f"EP{a.config.ep} holds 1/{a.config.ep} of the experts per GPU and {_pct(hidden)} of its "
                     "all-to-all is hidden behind the expert GEMMs")
    if a.config.pp > 1:
        parts.append(f"{a.config.num_microbatches} micro-batches over {a.config.pp} stages"
                     + (f" × {a.config.virtual_stages} chunks" if a.config.virtual_stages > 1 else "")
                     + f" keep the bubble at {_pct(a.bubble_fraction)}")
    if a.config.recompute == "none":
        parts.append("activations fit without recompute")
    elif a.config.recompute == "selective":
        parts.append("selective recompute saves the attention scores for little extra work")
    return "; ".join(parts)


def explanation_paragraph(p: Plan) -> str:
    if not p.ranked:
        return no_fit_message(p)
    best = p.ranked[0]
    text = (f"{label(best)} wins: {best.step_time:.3g} s per step, {_pct(best.mfu)} MFU, "
            f"{best.memory.total / GIB:.1f} GiB of {best.memory_capacity_gib:.3g} GiB; {why(best)}.")
    if len(p.ranked) > 1:
        text += " The runner-up " + compare(best, p.ranked[1])
    return text


def no_fit_message(p: Plan) -> str:
    if p.too_big:
        e = p.too_big[0]
        return (f"No layout fits in {e.memory_capacity_gib:.3g} GiB per GPU. The smallest, {label(e)}, needs "
                f"{e.memory.total / GIB:.1f} GiB on pipeline stage {e.memory.stage} "
                f"({', '.join(f'{k} {v:.1f}' for k, v in e.memory.as_gib().items() if k != 'total')} GiB): "
                + ("add GPUs (EP splits the experts over the data-parallel ones), " if p.model.is_moe else "add GPUs, ")
                + "use ZeRO-1/recompute, a smaller micro-batch, LoRA or QLoRA.")
    return "No valid layout: " + "; ".join(f"{r} ({n}×)" for r, n in p.rejected.most_common())


def format_plan(p: Plan, top: int = 10) -> str:
    lines = describe_inputs(p)
    rejected = sum(n for r, n in p.rejected.items() if r != "does not fit in GPU memory")
    lines.append(f"searched {p.evaluated + rejected} configurations: {p.evaluated} valid, "
                 f"{p.rejected.get('does not fit in GPU memory', 0)} of them too big for memory, "
                 f"{len(p.ranked)} layouts fit")
    for rule, n in p.rejected.most_common():
        if rule != "does not fit in GPU memory":
            lines.append(f"  rejected {n}×: {rule}")
    lines.append("")
    if p.ranked:
        lines.append(table(p.ranked[:top]))
        lines.append("")
        for i, e in enumerate(p.ranked[:top], 1):
            for note in e.notes:
                lines.append(f"  #{i}: {note}")
        best = p.ranked[0].time
        if p.train.task == "dpo" and p.train.online_reference:
            lines.append(f"  DPO reference ({p.train.dpo_reference}): a forward-only pass each step, "
                         f"{best.reference:.3g} s of #1's {best.total:.3g} s")
        elif p.train.task == "dpo":
            lines.append(f"  DPO reference (cached): one forward-only pass over the data before training, "
                         f"{best.reference_prepass:.3g} s per step of data at #1's layout; nothing per step")
        lines.append("")
    lines.append(explanation_paragraph(p))
    return "\n".join(lines)


def plan_as_dict(p: Plan, top: int = 10) -> dict:
    t, c = p.train, p.cluster
    return {
        "model": {**p.model.__dict__, "num_params": p.model.num_params()},
        "cluster": {"gpu": c.gpu.__dict__, "gpus_per_node": c.gpus_per_node, "nodes": c.nodes, "link": c.link,
                    "intra_node_gbs": c.intra_gbs, "inter_node_gbs": c.inter_gbs},
        "training": t.__dict__, "efficiency": p.efficiency.__dict__, "fixed": p.fixed,
        "evaluated": p.evaluated, "rejected": dict(p.rejected),
        "corrections": ({"machine": p.machine_key, **p.fit_used[1]} if p.fit_used else None),
        "ranked": [e.as_dict() for e in p.ranked[:top]],
        "explanation": explanation_paragraph(p),
    }


def format_explanation(x: Explanation) -> str:
    want = x.text
    if x.errors:
        lines = [f"{want} is not a valid layout for this job:"] + [f"  - {e}" for e in x.errors]
        if x.best:
            lines.append(f"The best valid layout is {label(x.best)} ({x.best.step_time:.3g} s per step, "
                         f"{_pct(x.best.mfu)} MFU).")
        return "\n".join(lines)
    e = x.estimate
    lines = [f"{want} → best setting {label(e)}", "", table([e]), ""]
    mem = ", ".join(f"{k} {v:.1f}" for k, v in e.memory.as_gib().items())
    lines.append(f"memory (GiB, pipeline stage {e.memory.stage}): {mem}")
    lines.append("time (s): " + ", ".join(f"{COMPONENTS[k]} {e.time.as_dict()[k]:.3g}" for k in COMPONENTS))
    problems = list(e.notes)
    if x.best and x.best.config != e.config:
        if x.best.step_time < e.step_time * 0.995:
            problems.append(f"{100 * (e.step_time / x.best.step_time - 1):.1f}% slower than the best layout: "
                            + compare(x.best, e))
    lines.append("")
    if problems:
        lines.append("What is wrong with it:")
        lines += [f"  - {p}" for p in problems]
    else:
        lines.append("Nothing is wrong with it: it is the best layout the planner found.")
    return "\n".join(lines)
