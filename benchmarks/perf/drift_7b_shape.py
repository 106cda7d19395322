"""Parameter drift of one module, exact (full SVDs) vs low-rank (top-k subspace iteration), on Qwen2.5-7B shapes.

For each shape, one random W0 with a power-law spectrum σ_i = i^-alpha (random orthonormal singular vectors) and
a rank-16 ΔW = B A with ‖ΔW‖_F / ‖W0‖_F = --delta-scale; then the code the drift report runs (`measure/drift.py`):
- exact: `measure.weight_drift.spectrum(W0)` once per run (`base`), then per report
  `measure.weight_drift.parameter_drift(W0, ΔW, base=...)` (the SVD of W0 + ΔW and the rest), float32 on the device;
- lowrank: `measure.lowrank_drift.base_spectrum(W0)` once per run, then per report
  `measure.lowrank_drift.lowrank_drift`.
Both per-report parts are timed (median of --repeats after one untimed run; the exact path once on CPU, where
it takes minutes), and the results of the two are compared (principal angle, top-k spectral shift, ‖ΔW‖_F), with
--reference against float64 full SVDs too (top-k singular values as well): on a GPU the float32 exact path is
not the truth either.
The projection for Qwen2.5-7B multiplies each shape's per-report time by its count among the 196 adapted
weights (28 layers x q, k, v, o, gate, up, down; down_proj is the transpose of gate/up, timed as such when
listed, else counted at gate/up's time).

    python benchmarks/perf/drift_7b_shape.py                                # CPU: gate/up, q/o, k/v shapes
    python benchmarks/perf/drift_7b_shape.py --device cuda --shapes gate_up,down,q_o,k_v --repeats 5

writes benchmarks/perf/results/drift_7b_shape-<device>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for adaptercl

import torch  # noqa: E402
from perf_common import write_result  # noqa: E402
from provenance import markdown_table, provenance  # noqa: E402

from adaptercl.measure import lowrank_drift, weight_drift  # noqa: E402

# Qwen2.5-7B: hidden 3584, MLP 18944, 28 layers, 4 KV heads of 128; [out, in] and count among the 196 weights
SHAPES = {
    "gate_up": ((18944, 3584), 56),
    "down": ((3584, 18944), 28),
    "q_o": ((3584, 3584), 56),
    "k_v": ((512, 3584), 56),
}


def make_weight(shape: tuple[int, int], alpha: float, device: torch.device, seed: int) -> torch.Tensor:
    """W0 [out, in] = U diag(i^-alpha) Vᵀ, U and V random orthonormal (float32, on `device`)."""
    g = torch.Generator().manual_seed(seed)
    out_f, in_f = shape
    m = min(shape)
    U = torch.linalg.qr(torch.randn(out_f, m, generator=g).to(device)).Q  # [out, m]
    V = torch.linalg.qr(torch.randn(in_f, m, generator=g).to(device)).Q  # [in, m]
    s = torch.arange(1, m + 1, device=device, dtype=torch.float32) ** -alpha  # [m]
    return (U * s) @ V.T


def make_delta(w0: torch.Tensor, rank: int, rel: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B [out, R], A [R, in] with ‖BA‖_F = rel · ‖W0‖_F."""
    g = torch.Generator().manual_seed(seed)
    B = torch.randn(w0.shape[0], rank, generator=g).to(w0.device)
    A = torch.randn(rank, w0.shape[1], generator=g).to(w0.device)
    B *= rel * torch.linalg.matrix_norm(w0) / torch.linalg.matrix_norm(B @ A)
    return B, A


def timed(fn, device: torch.device, repeats: int) -> tuple[object, list[float]]:
    """(result, seconds of each of `repeats` calls), after one untimed call when repeats > 1."""
    if repeats > 1:
        fn()
    times, result = [], None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return result, times


def measure(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    shape, count = SHAPES[name]
    k = args.k
    w0 = make_weight(shape, args.alpha, device, seed=0)
    B, A = make_delta(w0, args.rank, args.delta_scale, seed=1)
    delta = B @ A  # [out, in]; the exact path takes the dense ΔW

    exact_repeats = 1 if device.type == "cpu" else args.repeats
    base_exact, t_base_exact = timed(lambda: weight_drift.spectrum(w0, k), device, 1)
    exact, t_exact = timed(
        lambda: weight_drift.parameter_drift(w0, delta, k, torch.float32, device, base=base_exact),
        device,
        exact_repeats,
    )
    base_low, t_base_low = timed(lambda: lowrank_drift.base_spectrum(w0, k), device, 1)
    low, t_low = timed(lambda: lowrank_drift.lowrank_drift(w0, B, A, base_low, k), device, args.repeats)

    exact_after = weight_drift.spectrum(w0 + delta, k)
    start = torch.cat([base_low.Vh.T, A.T], 1)
    s1_low = lowrank_drift.top_triplets(w0, start, lowrank_drift.UPDATE_ITERATIONS, B, A)[0][:k]
    paths = {
        "exact_float32": {"s0": base_exact.s[:k], "s1": exact_after.s[:k], "angle": exact["principal_angle"]},
        "lowrank": {"s0": base_low.s[:k], "s1": s1_low, "angle": low["principal_angle"]},
    }
    for path in paths.values():
        path["shift_top_k"] = (
            torch.linalg.vector_norm(path["s1"] - path["s0"]) / torch.linalg.vector_norm(path["s0"])
        ).item()
    agreement = {
        name: {"principal_angle": p["angle"], "spectral_shift_top_k": p["shift_top_k"]} for name, p in paths.items()
    }
    agreement["exact_float32"]["spectral_shift_full"] = exact["spectral_shift"]
    agreement["exact_float32"]["relative_delta_norm"] = exact["relative_delta_norm"]
    agreement["lowrank"]["relative_delta_norm"] = low["relative_delta_norm"]
    if args.reference:  # float64 full SVDs on the device: the figures both float32 paths are judged against
        ref0 = weight_drift.spectrum(w0.double(), k)
        ref1 = weight_drift.spectrum((w0 + delta).double(), k)
        left, right = weight_drift.subspace_angles(ref0.U, ref0.Vh, ref1.U, ref1.Vh, k)
        s0, s1 = ref0.s[:k], ref1.s[:k]
        agreement["float64_reference"] = {
            "principal_angle": max(left, right),
            "spectral_shift_top_k": (torch.linalg.vector_norm(s1 - s0) / torch.linalg.vector_norm(s0)).item(),
            "spectral_shift_full": (
                torch.linalg.vector_norm(ref1.s - ref0.s) / torch.linalg.vector_norm(ref0.s)
            ).item(),
            "relative_delta_norm": (
                torch.linalg.matrix_norm(delta.double()) / torch.linalg.matrix_norm(w0.double())
            ).item(),
        }
        for name, p in paths.items():
            agreement[name]["top_k_singular_values_max_rel_err"] = max(
                ((p["s0"].double() - s0).abs() / s0).max().item(), ((p["s1"].double() - s1).abs() / s1).max().item()
            )
    per_report_exact, per_report_low = statistics.median(t_exact), statistics.median(t_low)
    return {
        "shape": list(shape),
        "count_in_qwen2.5_7b": count,
        "exact_base_once_s": t_base_exact[0],
        "exact_per_report_s": t_exact,
        "lowrank_base_once_s": t_base_low[0],
        "lowrank_per_report_s": t_low,
        "ratio_lowrank_over_exact": per_report_low / per_report_exact,
        "agreement": agreement,
    }


def project(results: dict[str, dict]) -> dict[str, float]:
    """Seconds for one report and for the once-per-run base part over the 196 weights of Qwen2.5-7B."""
    out = {}
    for key in ("exact_per_report_s", "lowrank_per_report_s", "exact_base_once_s", "lowrank_base_once_s"):
        total = 0.0
        for name, ((_, _), count) in SHAPES.items():
            source = results.get(name) or (results.get("gate_up") if name == "down" else None)
            if source is None:
                return {}
            value = source[key]
            total += count * (statistics.median(value) if isinstance(value, list) else value)
        out[key.replace("_s", "_qwen2.5_7b_s")] = total
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    parser.add_argument("--shapes", default="gate_up,q_o,k_v", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--rank", type=int, default=16, help="rank R of ΔW")
    parser.add_argument("--k", type=int, default=8, help="top-k (eval.drift_top_k)")
    parser.add_argument("--alpha", type=float, default=0.3, help="W0's spectrum: σ_i = i^-alpha")
    parser.add_argument("--delta-scale", type=float, default=0.02, help="‖ΔW‖_F / ‖W0‖_F")
    parser.add_argument("--repeats", type=int, default=3, help="timed low-rank reports (exact: 1 on CPU)")
    parser.add_argument("--reference", action="store_true", help="also float64 full SVDs, to judge both paths")
    args = parser.parse_args()
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 (the default; stated here)

    results = {}
    for name in args.shapes.split(","):
        results[name] = measure(name, args, device)
        print(f"{name}: {results[name]['ratio_lowrank_over_exact']:.4f}", flush=True)
    payload = {
        "benchmark": "drift_7b_shape",
        "device": str(device),
        "settings": {
            **vars(args),
            "oversample": lowrank_drift.OVERSAMPLE,
            "base_iterations": lowrank_drift.BASE_ITERATIONS,
            "update_iterations": lowrank_drift.UPDATE_ITERATIONS,
        },
        **provenance(("torch",)),
        "per_shape": results,
        "projection": project(results),
    }
    path = write_result(f"drift_7b_shape-{device.type}", payload)
    headers = [
        "shape",
        "exact s/report",
        "lowrank s/report",
        "lowrank/exact",
        "angle exact",
        "angle lowrank",
        "angle float64",
    ]
    rows = [
        [
            f"{name} {r['shape'][0]}x{r['shape'][1]}",
            statistics.median(r["exact_per_report_s"]),
            statistics.median(r["lowrank_per_report_s"]),
            f"{r['ratio_lowrank_over_exact']:.4f}",
            f"{r['agreement']['exact_float32']['principal_angle']:.6f}",
            f"{r['agreement']['lowrank']['principal_angle']:.6f}",
            f"{r['agreement'].get('float64_reference', {}).get('principal_angle', float('nan')):.6f}",
        ]
        for name, r in results.items()
    ]
    print(markdown_table(headers, rows))
    print(payload["projection"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
