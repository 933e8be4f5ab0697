"""`tpkernels plan --measure`: time this machine's GEMM rate, memory bandwidth and a collective,
and turn them into planner constants.

If the machine's accelerator is the GPU being planned for, the measured rates replace the
efficiency constants (gemm, hbm, link). Otherwise (a CPU, or another GPU) the planner plans for a
cluster of *this* device: its measured rates become the peaks, with efficiency 1.

On a CPU the ranks of ``tpkernels train --nproc N`` are processes with one thread each that share
the machine's cores, so everything is timed the way one rank sees it: with
``threads_per_rank`` threads, in fp32 (what training runs there), at the model's own GEMM
shapes. Four more rates make the prediction hold for the small models a CPU trains: the cost of
one op's dispatch (eager PyTorch pays it on the critical path), the attention core's rate, and
the latency and bandwidth of gloo collectives between two ranks. ``calibrate`` then shares the
cores among the cluster's ranks. When the plan's ranks outnumber the cores, the collectives are
timed again on that many ranks, all computing: a rank that reaches a collective then waits for its
peer to get a core back, which costs milliseconds where the idle timing sees tens of microseconds.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from tpkernels.planner.efficiency import Efficiency
from tpkernels.planner.hardware import ClusterSpec, GPUSpec
from tpkernels.description import ModelConfig
from tpkernels.planner.workload import TrainingSetup

CPU_TOKENS, GPU_TOKENS = 256, 8192  # GEMM rows timed; the CPU size keeps --measure near a second
CPU_MAX_WIDTH = 4096  # cap on the CPU GEMM width, same reason


@dataclass(frozen=True)
class Measurement:
    device: str  # "cuda" or "cpu"
    device_name: str
    gemm_tflops: float  # achieved over one layer's four linear GEMMs
    gemm_dtype: str
    gemm_flops: float  # FLOPs of the timed layer
    copy_gbs: float  # (read + write bytes) / time of a large device copy
    memory_gib: float
    collective: str | None = None
    busbw_gbs: float | None = None  # all-reduce bus bandwidth, 2(n-1)/n · bytes / time
    threads: int = 1  # threads the rates were timed with (CPU)
    cores: int = 1  # cores of this machine (CPU)
    op_overhead_s: float = 0.0  # one small op's dispatch, forward + its autograd backward (CPU)
    attention_tflops: float | None = None  # causal attention forward+backward, full-count FLOPs (CPU)
    collective_latency_s: float = 0.0  # a tiny all-reduce between two ranks
    p2p_gbs: float | None = None  # one direction of a pairwise exchange of a TP-sized message
    elementwise_gbs: float | None = None  # (read + write bytes) / time of exp / mul / add (CPU)
    optimizer_s_per_param: float | None = None  # AdamW step + gradient norm (CPU)
    loss_s_per_logit: float | None = None  # cross-entropy softmax passes, forward + backward (CPU)
    # With more ranks than cores (CPU), timed on that many ranks, all computing between collectives
    # in pairs: what a tiny all-reduce and a TP-sized one add to the compute (a descheduled peer's wait).
    contended_ranks: int = 0
    contended_latency_s: float | None = None
    contended_busbw_gbs: float | None = None

    def describe(self) -> str:
        text = (f"{self.device_name}: GEMM {self.gemm_tflops:.3g} TFLOP/s ({self.gemm_dtype}), "
                f"copy {self.copy_gbs:.0f} GB/s, {self.memory_gib:.0f} GiB")
        if self.device == "cpu":
            text += (f" (one rank: {self.threads} thread(s) of {self.cores} cores), op dispatch "
                     f"{1e6 * self.op_overhead_s:.1f} µs")
            if self.attention_tflops:
                text += f", attention {self.attention_tflops:.3g} TFLOP/s"
            if self.elementwise_gbs:
                text += f", elementwise {self.elementwise_gbs:.3g} GB/s"
        if self.busbw_gbs is not None:
            text += (f", {self.collective} bus bandwidth {self.busbw_gbs:.2f} GB/s, "
                     f"latency {1e6 * self.collective_latency_s:.0f} µs")
            if self.p2p_gbs:
                text += f", pairwise exchange {self.p2p_gbs:.2f} GB/s"
            if self.contended_latency_s is not None:
                text += (f"; with {self.contended_ranks} ranks computing: latency "
                         f"{1e6 * self.contended_latency_s:.0f} µs, bus bandwidth {self.contended_busbw_gbs:.2f} GB/s")
        else:
            text += ", no collective measured (one device)"
        return text


def _median_time(fn, sync, reps: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def layer_gemm_shapes(model: ModelConfig, tokens: int, max_width: int | None = None) -> list[tuple[int, int, int]]:
    """(M, K, N) of the four linear GEMMs of one layer: QKV, output projection, MLP up(+gate), down."""
    h, q, kv, f = model.hidden_size, model.q_dim, model.kv_dim, model.ffn_hidden_size
    up = f * (model.mlp_matrices - 1)
    shapes = [(tokens, h, q + 2 * kv), (tokens, q, h), (tokens, h, up), (tokens, f, h)]
    if max_width:
        scale = min(1.0, max_width / h)
        shapes = [(m, max(64, int(k * scale)), max(64, int(n * scale))) for m, k, n in shapes]
    return shapes


def _allreduce_worker(rank: int, world_size: int, numel: int, reps: int, p2p_numel: int = 2**18
                      ) -> tuple[float, float, float]:
    """(bus bandwidth GB/s of a ``numel`` all-reduce, seconds of a 1-element one, GB/s of a pairwise
    exchange of ``p2p_numel`` fp32 values each way)."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from tpkernels.parallel import control  # noqa: PLC0415

    dev = control.control_device()
    x = torch.ones(numel, device=dev)
    tiny = torch.ones(1, device=dev)
    sync = torch.cuda.synchronize if dev.type != "cpu" else (lambda: None)
    dist.all_reduce(x)
    sync()
    control.barrier()
    t = _median_time(lambda: dist.all_reduce(x), sync, reps)
    latency = _median_time(lambda: dist.all_reduce(tiny), sync, 4 * reps)
    # a pairwise exchange of a TP-sized message (what the ring GEMM-comm ops and pipeline P2P do)
    msg = torch.ones(p2p_numel, device=dev)
    back = torch.empty_like(msg)
    peer = (rank + 1) % world_size

    def exchange():
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, msg, peer), dist.P2POp(dist.irecv, back, peer)])
        for r in reqs:
            r.wait()

    tp2p = _median_time(exchange, sync, reps)
    return (2 * (world_size - 1) / world_size * x.numel() * x.element_size() / t / 1e9, latency,
            msg.numel() * msg.element_size() / tp2p / 1e9)


def _contended_worker(rank: int, world_size: int, shape: tuple[int, int, int], numel: int, reps: int
                      ) -> tuple[float, float]:
    """(seconds a 1-element all-reduce adds to a GEMM, seconds a ``numel`` fp32 one adds) when every
    rank runs that GEMM and then the all-reduce within its pair, over and over. With more ranks than
    cores a rank reaching a collective waits until its peer is scheduled again: a cost the idle
    2-rank timing does not see (TP layouts on an oversubscribed CPU pay it at every collective)."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from tpkernels.parallel import control  # noqa: PLC0415

    groups = [dist.new_group(list(range(g, min(g + 2, world_size)))) for g in range(0, world_size, 2)]
    mine = groups[rank // 2]
    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    tiny, big = torch.ones(1), torch.ones(numel)

    def per_iteration(x) -> float:
        control.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
            if x is not None:
                dist.all_reduce(x, group=mine)
        control.barrier()
        return (time.perf_counter() - t0) / reps

    per_iteration(tiny)  # warm-up: the pair's first collective connects
    rounds = [(per_iteration(None), per_iteration(tiny), per_iteration(big)) for _ in range(5)]
    base, with_tiny, with_big = (sorted(r[i] for r in rounds)[2] for i in range(3))
    return max(0.0, with_tiny - base), max(0.0, with_big - base)


def _op_overhead(torch, reps: int = 200) -> float:
    """Seconds of one tiny op forward plus its backward: eager dispatch and autograd bookkeeping."""
    x = torch.ones(8, requires_grad=True)
    ops = 20

    def run():
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()

    return _median_time(run, lambda: None, reps // ops + 3) / (ops + 2)


def _elementwise_gbs(torch) -> float:
    """Bytes per second of a chain of memory-bound ops (exp, multiply-add), one rank's threads:
    on a CPU these run far below the copy bandwidth (exp is computed, not streamed)."""
    x = torch.randn(2**21)
    y = torch.empty_like(x)

    def run():
        torch.exp(x, out=y)
        y.mul_(0.5).add_(x)

    t = _median_time(run, lambda: None, 7)
    return 6 * x.numel() * x.element_size() / t / 1e9  # three passes, each reads and writes


def _optimizer_s_per_param(torch) -> float:
    """Seconds per parameter of one AdamW step (torch's foreach implementation, fp32, as the
    trainer runs it on a CPU), with the gradient-norm pass the trainer's clipping adds. 8M
    parameters (128 MiB of weights, gradients and moments): out of the caches, as a model's are
    (2M ran 1.4× faster per parameter here, from the last-level cache)."""
    params = [torch.zeros(2**18, requires_grad=True) for _ in range(32)]
    for q in params:
        q.grad = torch.randn_like(q)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def run():
        torch._foreach_norm([q.grad for q in params])
        opt.step()

    return _median_time(run, lambda: None, 5) / sum(q.numel() for q in params)


def _loss_s_per_logit(torch, model: ModelConfig, tokens: int) -> float:
    """Seconds per logit of the cross-entropy's softmax passes, forward and backward, without its
    GEMMs (F.cross_entropy over materialised logits: the same passes our chunked loss makes)."""
    import torch.nn.functional as F  # noqa: PLC0415

    vocab = min(model.vocab_size, 8192)
    logits = torch.randn(tokens, vocab, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))

    def run():
        F.cross_entropy(logits, target).backward()

    return _median_time(run, lambda: None, 3) / logits.numel()


def _attention_rate(torch, model: ModelConfig, train: TrainingSetup) -> float:
    """Full-count TFLOP/s of causal SDPA forward+backward at the model's shape (one sequence)."""
    import torch.nn.functional as F  # noqa: PLC0415

    heads, d, s = min(model.num_attention_heads, 8), model.dhead, min(train.seq_length, 2048)
    q, k, v = (torch.randn(1, heads, s, d, requires_grad=True) for _ in range(3))

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    t = _median_time(run, lambda: None, 3)
    return 3.5 * 4.0 * s * s * heads * d / t / 1e12  # forward 4·s²·h·d, backward 2.5×


def measure(model: ModelConfig, train: TrainingSetup, collective: bool = True, threads_per_rank: int = 1,
            micro_batch_size: int = 1, ranks: int = 2) -> Measurement:
    """``ranks``: how many ranks the plan is for; on a CPU whose cores they outnumber, the collectives
    are timed again with that many ranks computing (:func:`_contended_worker`)."""
    import torch  # noqa: PLC0415

    on_gpu = torch.cuda.is_available()
    if not on_gpu:  # time what one rank of `tpkernels train --nproc` sees
        saved_threads = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank)
        try:
            return _measure(torch, model, train, collective, on_gpu, micro_batch_size, ranks, threads_per_rank)
        finally:
            torch.set_num_threads(saved_threads)
    return _measure(torch, model, train, collective, on_gpu, micro_batch_size, ranks, threads_per_rank)


def _measure(torch, model: ModelConfig, train: TrainingSetup, collective: bool, on_gpu: bool,
             micro_batch_size: int, plan_ranks: int, threads_per_rank: int) -> Measurement:
    dev = "cuda" if on_gpu else "cpu"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    # bf16 on GPUs (what training runs); fp32 on CPUs, where bf16 GEMMs are emulated on many parts.
    dtype = torch.bfloat16 if on_gpu else torch.float32
    cpu_tokens = min(max(micro_batch_size * train.seq_length, 64), 4 * CPU_TOKENS)
    shapes = layer_gemm_shapes(model, GPU_TOKENS if on_gpu else cpu_tokens, None if on_gpu else CPU_MAX_WIDTH)
    pairs = [(torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype))
             for m, k, n in shapes]
    flops = sum(2.0 * m * k * n for m, k, n in shapes)
    if on_gpu:
        t = _median_time(lambda: [a @ b for a, b in pairs], sync, reps=5)
    else:
        # A CPU's backward GEMMs (transposed operands) run at their own rate: time forward, input
        # gradient and weight gradient together, as training runs them.
        for a, b in pairs:
            a.requires_grad_(True)
            b.requires_grad_(True)
        grads = [torch.ones(m, n) for m, _, n in shapes]

        def fwd_bwd():
            outs = [a @ b for a, b in pairs]
            torch.autograd.backward(outs, grads)

        t = _median_time(fwd_bwd, sync, reps=5) / 3.0
    del pairs
    src = torch.empty(2**26 if on_gpu else 2**24, device=dev)  # 256 MiB / 64 MiB of fp32
    dst = torch.empty_like(src)
    tc = _median_time(lambda: dst.copy_(src), sync, reps=7)
    copy_gbs = 2 * src.numel() * src.element_size() / tc / 1e9
    del src, dst
    if on_gpu:
        name = torch.cuda.get_device_name()
        mem = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        import platform  # noqa: PLC0415

        name = f"CPU {platform.machine()} ×{torch.get_num_threads()} threads"
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    coll = busbw = p2p_gbs = None
    latency = 0.0
    ranks = 2
    if collective and (not on_gpu or torch.cuda.device_count() >= ranks):
        from tpkernels.parallel.local_ranks import run_on_ranks  # noqa: PLC0415

        backend = "nccl" if on_gpu else "gloo"
        numel = 2**26 if on_gpu else 2**22
        # the TP message of one micro-batch: tokens × hidden activations
        p2p_numel = max(1024, micro_batch_size * train.seq_length * model.hidden_size // ranks)
        results = run_on_ranks(_allreduce_worker, ranks, numel, 5, p2p_numel, backend=backend, timeout=120)
        busbw, latency = min(r[0] for r in results), max(r[1] for r in results)
        p2p_gbs = min(r[2] for r in results)
        coll = f"{backend} all-reduce over {ranks} ranks"
    extra = {}
    cores = os.cpu_count() or 1
    # (a plan for more than 2 ranks per core is not timed: it would start that many processes here)
    if collective and not on_gpu and cores < plan_ranks * threads_per_rank <= 2 * cores:
        from tpkernels.parallel.local_ranks import RankPool  # noqa: PLC0415

        # one layer's first GEMM at TP2, the width a TP pair computes between collectives
        m, k, n = shapes[0]
        shape = (m, k, max(64, n // 2))
        # at least 2 MiB: the bandwidth is a difference of two timings, and a small message drowns in it
        numel = max(2**19, micro_batch_size * train.seq_length * model.hidden_size // 2)
        with RankPool(plan_ranks, backend="gloo", timeout=300, threads_per_rank=threads_per_rank) as pool:
            out = pool.run(_contended_worker, shape, numel, 40)
        tiny_s = sorted(r[0] for r in out)[len(out) // 2]
        big_s = sorted(r[1] for r in out)[len(out) // 2]
        extra = dict(contended_ranks=plan_ranks, contended_latency_s=tiny_s,
                     contended_busbw_gbs=numel * 4 / max(big_s - tiny_s, 1e-9) / 1e9)  # 2(n−1)/n = 1 for a pair
    if not on_gpu:
        extra.update(threads=torch.get_num_threads(), cores=cores, op_overhead_s=_op_overhead(torch),
                     attention_tflops=_attention_rate(torch, model, train), elementwise_gbs=_elementwise_gbs(torch),
                     optimizer_s_per_param=_optimizer_s_per_param(torch),
                     loss_s_per_logit=_loss_s_per_logit(torch, model, cpu_tokens))
    return Measurement(dev, name, flops / t / 1e12, str(dtype).replace("torch.", ""), flops, copy_gbs, mem,
                       coll, busbw, collective_latency_s=latency, p2p_gbs=p2p_gbs, **extra)


def _same_gpu(spec: GPUSpec, device_name: str) -> bool:
    """Does CUDA's device name (e.g. 'NVIDIA H100 80GB HBM3') denote this preset?"""
    family = spec.name.split("-")[0].upper()  # A100, H100, H200, A10, L20
    words = device_name.upper().replace("-", " ").split()
    if family not in words:
        return False
    if spec.name.endswith("PCIe") != ("PCIE" in words):
        return False
    # a preset named for its memory (A100-40GB, H100-96GB-500W) is not a device that states another size
    size, stated = _memory_word(spec.name.upper().split("-")), _memory_word(words)
    return size is None or stated is None or size == stated


def _memory_word(words) -> str | None:
    return next((w for w in words if w.endswith("GB") and w[:-2].isdigit()), None)


def preset_for_device(device_name: str) -> GPUSpec | None:
    """The planner's GPU preset that CUDA's device name denotes, if any."""
    from tpkernels.planner.hardware import GPU_PRESETS  # noqa: PLC0415

    matches = [spec for spec in GPU_PRESETS.values() if _same_gpu(spec, device_name)]
    stated = _memory_word(device_name.upper().replace("-", " ").split())
    # the preset named for the stated memory size first (an H100 96GB is not the 80 GB H100-SXM)
    matches.sort(key=lambda spec: _memory_word(spec.name.upper().split("-")) != stated)
    return matches[0] if matches else None


def calibrate(cluster: ClusterSpec, eff: Efficiency, meas: Measurement) -> tuple[ClusterSpec, Efficiency, list[str]]:
    """Constants (and, for a foreign device, the device itself) from a measurement."""
    notes = []
    if meas.device == "cuda" and _same_gpu(cluster.gpu, meas.device_name):
        gpu = cluster.gpu
        changes = {"gemm": min(1.0, meas.gemm_tflops / gpu.peak_tflops_bf16),
                   "hbm": min(1.0, meas.copy_gbs / gpu.hbm_gbs)}
        if meas.busbw_gbs is not None:
            changes["link"] = min(1.0, meas.busbw_gbs / cluster.intra_gbs)
        notes.append(f"this is a {gpu.name}: constants set from the measurement: "
                     + ", ".join(f"{k} {v:.2f}" for k, v in changes.items()))
        return cluster, eff.replace(**changes), notes
    # CPU ranks share the cores: with more ranks than cores each gets a 1/oversubscription share of
    # the measured (one rank, ``threads`` threads) rates.
    share = 1.0
    if meas.device == "cpu":
        share = min(1.0, meas.cores / max(1, cluster.num_gpus * meas.threads))
    rate = meas.gemm_tflops * share
    link = meas.busbw_gbs if meas.busbw_gbs is not None else cluster.intra_gbs
    if meas.device == "cpu" and meas.p2p_gbs:
        # gloo moves the TP layers' ring chunks and the pipeline's activations as pairwise
        # send/recv, slower per byte than its all-reduce: plan the links at that rate
        link = min(link, meas.p2p_gbs)
    contended = (meas.device == "cpu" and meas.contended_latency_s is not None
                 and meas.contended_ranks == cluster.num_gpus)
    if contended and meas.contended_busbw_gbs:
        link = min(link, meas.contended_busbw_gbs)
    gpu = GPUSpec(
        name=f"measured {meas.device_name}", peak_tflops_bf16=rate, memory_gib=meas.memory_gib,
        # memory-bound kernels: on a CPU at the measured elementwise rate, not memcpy's
        hbm_gbs=(meas.elementwise_gbs or meas.copy_gbs) * share, nvlink_gbs=None, pcie_gbs=link,
        inter_node_gbs=meas.busbw_gbs if meas.busbw_gbs is not None else cluster.inter_gbs,
        peak_tflops_fp8=rate, peak_tflops_fp32=rate, sm_count=1, tile_m=1, tile_n=1,
        generation="cpu" if meas.device == "cpu" else cluster.gpu.generation,
    )
    notes.append(f"this machine's device ({meas.device_name}) is not a {cluster.gpu.name}: planning for "
                 f"{cluster.nodes}×{cluster.gpus_per_node} of this device at its measured rates (efficiency 1)")
    mine = ClusterSpec(gpu, cluster.gpus_per_node, cluster.nodes, "pcie", gpu.pcie_gbs, gpu.inter_node_gbs)
    # The measured rates already include every loss the GEMM model would add on a GPU (no waves,
    # no tiles, the real k): efficiency 1. Dispatch and collective latencies are measured, and
    # oversubscribed ranks wait for a core to run them too.
    changes = dict(gemm=1.0, gemm_fp8=1.0, gemm_k0=0.0, gemm_tail=0.0, hbm=1.0, link=1.0)
    if meas.device == "cpu":
        slow = 1.0 / share
        changes.update(core_share=share, gemm_launch_s=meas.op_overhead_s * slow,
                       kernel_launch_s=meas.op_overhead_s * slow,
                       # a 2-rank all-reduce is two ring steps; with more ranks than cores, what
                       # it cost with all of them computing (the wait for a descheduled peer)
                       collective_latency_s=(meas.contended_latency_s if contended
                                             else meas.collective_latency_s * slow) / 2,
                       p2p_latency_s=meas.contended_latency_s if contended else meas.collective_latency_s * slow,
                       # gloo makes progress on the CPU the compute is using: nothing hides
                       tp_overlap=0.0, elementwise_traffic=eff.elementwise_traffic)
        if meas.attention_tflops:
            changes["attention"] = min(1.0, meas.attention_tflops / meas.gemm_tflops)
        # the optimizer and the loss's softmax passes at their measured speed, expressed in the
        # planner's units (bytes moved at the memory-bound rate)
        bw = gpu.hbm_gbs * 1e9
        if meas.optimizer_s_per_param:
            changes["optimizer_bytes_per_param"] = meas.optimizer_s_per_param * slow * bw
        if meas.loss_s_per_logit:
            changes["logit_traffic"] = meas.loss_s_per_logit * slow * bw / 4.0  # per 4-byte fp32 logit
        notes.append(f"{cluster.num_gpus} ranks × {meas.threads} thread(s) on {meas.cores} cores: each rank gets "
                     f"{100 * share:.0f}% of the measured rates"
                     + (", and its collectives the latency and bandwidth timed with that many ranks computing"
                        if contended else ""))
    return mine, eff.replace(**changes), notes
