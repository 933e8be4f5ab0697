"""The planner learns from the layouts a run measured: three corrections fitted to the autotune
trials, kept per machine, used by every later plan on that machine.

    measured step ≈ compute_scale · (GEMMs + memory-bound kernels + bubble + optimizer)
                  + comm_scale · (exposed TP, CP, EP, P2P and DP communication)
                  + op_overhead_s · (kernels on the critical path, StepTime.ops)

The first term says how fast this machine really computes against the planner's rates, the second
how fast its links are, the third what each kernel costs beyond its work (Python dispatch, autograd
bookkeeping, a rank waiting for a core to launch it). All three are rates: a fit made on one model
scales with the next model's work (a fixed cost per step, the old third term, made a 4-layer
model's +75.7 ms the plan of a 50× smaller model's 0.057 s step). The fit is a least-squares
solve on relative errors with a pull toward (1, 1, 0) as strong as the trials are noisy (:func:`fit`),
so that a few noisy trials cannot send a term they barely exercised far off, while trials the model
explains exactly are fitted exactly; a term no trial exercised (no communication) stays at its prior.
A cached fit of the old form (a fixed per-step overhead) is ignored: it does not transfer.

The cache is one JSON file (``$TPKERNELS_CACHE_DIR``, else ``$XDG_CACHE_HOME/tpkernels``, else
``~/.cache/tpkernels``: ``planner_fits.json``), keyed by the machine: the planner's GPU name and
the GPU count, or the CPU and the rank count (:func:`machine_key`).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from tpkernels.planner.efficiency import Efficiency

NOISE = 0.05  # relative step-time noise assumed when the trials leave none to measure (shared CPUs: ±5%)
# the prior's spread: a scale is a priori within ±50% of the measured rates (and the per-op cost within half
# a typical step's time per op). Chosen on this stop's two world-4 runs (benchmarks/planner_vs_trainer.py --refit-csv):
# at 0.5 both predict all six untried layouts within ±20%; 1.0 leaves TP4 at −35% in one, 0.3 and less
# leave one layout at 22–24% in the other.
SPREAD = 0.5
MIN_PULL = 1e-10  # keeps a term no trial exercised at its prior when the trials are exact
LOW, HIGH = (0.05, 0.05, 0.0), (20.0, 20.0, float("inf"))  # compute, comm scales; seconds per op


@dataclass(frozen=True)
class Fit:
    compute_scale: float
    comm_scale: float
    op_overhead_s: float
    n: int = 0  # trials it was fitted on
    worst_error: float = 0.0  # the largest |relative error| left on those trials

    def apply(self, eff: Efficiency) -> Efficiency:
        return eff.replace(compute_scale=self.compute_scale, comm_scale=self.comm_scale,
                           op_overhead_s=self.op_overhead_s)

    def predict(self, compute_s: float, comm_s: float, ops: float) -> float:
        """A step's seconds from its uncorrected (compute, exposed comm) seconds and its kernel count."""
        return self.compute_scale * compute_s + self.comm_scale * comm_s + self.op_overhead_s * ops

    def describe(self) -> str:
        return (f"compute ×{self.compute_scale:.3g}, communication ×{self.comm_scale:.3g}, "
                f"+{1e6 * (self.op_overhead_s or 0.0):.3g} µs per kernel (fitted on {self.n} measured layout(s), worst "
                f"residual {100 * self.worst_error:.1f}%)")


def components(time, eff: Efficiency) -> tuple[float, float, float]:
    """(compute s, exposed communication s, kernels on the critical path) of a StepTime made with
    ``eff``, without its corrections."""
    compute = time.gemm + time.elementwise + time.bubble + time.optimizer
    comm = time.tp_exposed + time.cp_exposed + time.ep_exposed + time.p2p + time.dp_exposed
    return compute / eff.compute_scale, comm / eff.comm_scale, time.ops


def _solve(a, b, pull: float, typical: float) -> list[float]:
    """Bounded least squares of ``a x ≈ b`` with a prior row per term of weight √pull (active set)."""
    import torch  # noqa: PLC0415  (a 3×3 solve; torch is here anyway)

    w = math.sqrt(pull)
    # the prior: scales 1, per-op overhead 0 (its column in units of a typical step: typical = step / ops)
    prior = torch.tensor([[w, 0.0, 0.0], [0.0, w, 0.0], [0.0, 0.0, w / typical]], dtype=torch.float64)
    a = torch.cat([a, prior])
    b = torch.cat([b, torch.tensor([[w], [w], [0.0]], dtype=torch.float64)])
    fixed: dict[int, float] = {}
    x: dict[int, float] = {}
    for _ in range(3):  # active set: a value outside its bounds is pinned there and the rest refitted
        free = [i for i in range(3) if i not in fixed]
        rest = b - sum((a[:, i:i + 1] * v for i, v in fixed.items()), torch.zeros_like(b))
        sol = torch.linalg.lstsq(a[:, free], rest).solution[:, 0].tolist() if free else []
        x = dict(fixed)
        x.update(zip(free, sol))
        out = [i for i in free if not LOW[i] <= x[i] <= HIGH[i]]
        if not out:
            break
        worst_i = max(out, key=lambda i: max(LOW[i] - x[i], x[i] - HIGH[i]))
        fixed[worst_i] = min(max(x[worst_i], LOW[worst_i]), HIGH[worst_i])
    return [min(max(x[i], LOW[i]), HIGH[i]) for i in range(3)]


def _noise_pull(a, b, typical: float) -> float:
    """The prior's weight from the trials' scatter: a nearly free fit's residual variance on the
    degrees of freedom the trials leave (the rank of their design), over SPREAD²."""
    import torch  # noqa: PLC0415

    sv = torch.linalg.svdvals(a * torch.tensor([1.0, 1.0, typical], dtype=torch.float64))  # overhead in steps
    spare = a.shape[0] - int((sv > 1e-9 * sv.max()).sum())
    if spare <= 0:
        return NOISE ** 2 / SPREAD ** 2
    free = torch.tensor(_solve(a, b, MIN_PULL, typical), dtype=torch.float64)[:, None]
    return max(MIN_PULL, float(((a @ free - b) ** 2).sum()) / spare / SPREAD ** 2)


def fit(samples: list[tuple[float, float, float, float]], pull: float | None = None) -> Fit:
    """``samples``: (compute s, exposed comm s, kernels on the critical path, measured s) per trial,
    at uncorrected rates.

    The prior's weight is the trials' own noise: a first, nearly free fit measures the scatter the
    three terms cannot explain (its variance, on the degrees of freedom left), and that variance over
    :data:`SPREAD`² is the pull toward (1, 1, 0), as in ridge regression. Trials that the
    model explains exactly are recovered exactly; noisy trials keep directions they barely
    determine (compute against a fixed overhead, on one world size) near the prior. With no spare
    trial to measure scatter, :data:`NOISE` is assumed. ``pull`` fixes the weight instead.
    """
    import torch  # noqa: PLC0415

    samples = [(c, m, k, t) for c, m, k, t in samples if t > 0 and math.isfinite(t)]
    if not samples:
        raise ValueError("fit needs at least one measured step time > 0")
    if any(not (k >= 0 and math.isfinite(k)) for _, _, k, _ in samples):
        raise ValueError("fit: kernel counts must be finite and >= 0")
    a = torch.tensor([[c / t, m / t, k / t] for c, m, k, t in samples], dtype=torch.float64)
    b = torch.ones(len(samples), 1, dtype=torch.float64)
    # a typical per-op cost: a typical step over its kernel count (the prior's scale for the third term)
    typical = sorted(t / k if k > 0 else t for _, _, k, t in samples)[len(samples) // 2]
    if pull is None:
        pull = _noise_pull(a, b, typical)
    elif not pull > 0:
        raise ValueError(f"pull ({pull}) must be > 0")
    cs, ms, g = _solve(a, b, pull, typical)
    worst = max(abs((cs * c + ms * m + g * k) / t - 1) for c, m, k, t in samples)
    return Fit(cs, ms, g, len(samples), worst)


def machine_key(device: str, ranks: int) -> str:
    """``device``: the planner's GPU name (``H100-SXM``), or "cpu" for this host's CPU."""
    if device == "cpu":
        return f"cpu {platform.machine()} {os.cpu_count()} cores, {ranks} ranks"
    return f"{device}, {ranks} GPUs"


def cache_path() -> Path:
    from tpkernels.env_vars import read  # noqa: PLC0415

    root = read("TPKERNELS_CACHE_DIR")
    if root:
        return Path(root) / "planner_fits.json"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tpkernels" / "planner_fits.json"


def _read() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load(key: str) -> tuple[Fit, dict] | None:
    """The fit kept for ``key`` and its record (date, layouts), or None (no cache, unreadable, absent)."""
    rec = _read().get(key)
    if not isinstance(rec, dict):
        return None
    try:
        f = Fit(float(rec["compute_scale"]), float(rec["comm_scale"]), float(rec["op_overhead_s"]),
                int(rec.get("n", 0)), float(rec.get("worst_error", 0.0)))
    except (KeyError, TypeError, ValueError):
        return None
    return f, rec


def save(key: str, f: Fit, **context) -> Path:
    """Keep ``f`` for ``key`` (replacing the machine's previous fit); returns the file."""
    data = _read()
    data[key] = {"compute_scale": f.compute_scale, "comm_scale": f.comm_scale, "op_overhead_s": f.op_overhead_s,
                 "n": f.n, "worst_error": f.worst_error, "date": datetime.date.today().isoformat(), **context}
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path


__all__ = ["Fit", "cache_path", "components", "fit", "load", "machine_key", "save"]
