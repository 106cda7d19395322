"""Tests for adaptercl.measure.metrics: CL metrics over the accuracy matrix, parameter drift, response drift."""

import json
import math

import numpy as np
import pytest
import torch

from adaptercl.measure.metrics import (
    CL_METRIC_DEFINITIONS,
    cl_metrics,
    mean_entropy,
    pattern_rate,
    repeated_ngram_rate,
    stage_forgetting,
    token_js,
    token_kl,
)
from adaptercl.measure.weight_drift import (
    aggregate_drift,
    parameter_drift,
    principal_angle,
    relative_delta_norm,
    spectral_shift,
    spectrum,
)

# a[k][j]: row 0 before training, stage k trains column k - 1
ACC_4x3 = [
    [0.2, 0.1, 0.3],
    [0.8, 0.2, 0.3],
    [0.6, 0.7, 0.4],
    [0.5, 0.6, 0.9],
]
# hand computation for ACC_4x3 (T = 3)
HAND = {
    "acc": (0.5 + 0.6 + 0.9) / 3,
    "average_accuracy": (0.8 + (0.6 + 0.7) / 2 + (0.5 + 0.6 + 0.9) / 3) / 3,
    "bwt": ((0.5 - 0.8) + (0.6 - 0.7)) / 2,
    "forgetting": (max(0.8, 0.6) - 0.5 + max(0.2, 0.7) - 0.6) / 2,  # max over rows 1..T-1
    "forgetting_from_base": (max(0.2, 0.8, 0.6) - 0.5 + max(0.1, 0.2, 0.7) - 0.6) / 2,  # rows 0..T-1: the same here
    "fwt": ((0.2 - 0.1) + (0.4 - 0.3)) / 2,  # GEM: stages 2..T, divided by T - 1 (0.1, not 0.2 / 3)
    "plasticity": ((0.8 - 0.2) + (0.7 - 0.2) + (0.9 - 0.4)) / 3,
}


def assert_headline(result: dict, expected: dict, tol: float = 1e-12) -> None:
    for key, value in expected.items():
        if value is None:
            assert result[key] is None, key
        else:
            assert result[key] == pytest.approx(value, abs=tol), key


def test_cl_metrics_matches_hand_computation() -> None:
    result = cl_metrics(ACC_4x3)
    assert_headline(result, HAND)
    assert result["num_stages"] == 3 and result["trained_columns"] == [0, 1, 2]
    per_domain = {d["column"]: d for d in result["per_domain"]}
    assert per_domain[0]["forgetting"] == pytest.approx(0.3) and per_domain[1]["forgetting"] == pytest.approx(0.1)
    assert per_domain[2]["forgetting"] is None and per_domain[2]["bwt"] is None  # trained last
    assert per_domain[0]["fwt"] is None  # trained first: nothing before it to transfer from
    assert per_domain[1]["fwt"] == pytest.approx(0.1) and per_domain[2]["fwt"] == pytest.approx(0.1)
    assert [s["plasticity"] for s in result["per_stage"]] == pytest.approx([0.6, 0.5, 0.5])
    assert result["retention"] == {"probes": [], "mean_before": None, "mean_after": None, "mean_change": None}
    json.dumps(result, allow_nan=False)  # JSON-ready: no NaN, no tensors


def test_cl_metrics_accepts_tensor() -> None:
    assert_headline(cl_metrics(torch.tensor(ACC_4x3, dtype=torch.float64)), HAND)
    assert_headline(cl_metrics(torch.tensor(ACC_4x3)), HAND, tol=1e-6)  # float32 input


def test_cl_metrics_with_retention_probe_column() -> None:
    # the same trained domains as ACC_4x3 with a probe inserted as column 1
    acc = [
        [0.2, 0.50, 0.1, 0.3],
        [0.8, 0.45, 0.2, 0.3],
        [0.6, 0.40, 0.7, 0.4],
        [0.5, 0.48, 0.6, 0.9],
    ]
    result = cl_metrics(acc, trained_columns=[0, 2, 3])
    assert_headline(result, HAND)
    (probe,) = result["retention"]["probes"]
    assert probe["column"] == 1
    assert probe["before"] == pytest.approx(0.5) and probe["after"] == pytest.approx(0.48)
    assert probe["change"] == pytest.approx(-0.02) and probe["min"] == pytest.approx(0.40)
    assert result["retention"]["mean_change"] == pytest.approx(-0.02)


def test_cl_metrics_default_columns_leave_extra_columns_as_probes() -> None:
    acc = [[0.2, 0.1, 0.9], [0.8, 0.2, 0.7], [0.6, 0.7, 0.8]]  # T = 2, column 2 never trained
    result = cl_metrics(acc)
    assert [p["column"] for p in result["retention"]["probes"]] == [2]
    assert result["retention"]["probes"][0]["change"] == pytest.approx(-0.1)
    assert result["retention"]["probes"][0]["min"] == pytest.approx(0.7)
    assert result["acc"] == pytest.approx(0.65) and result["bwt"] == pytest.approx(-0.2)


def test_cl_metrics_single_stage() -> None:
    result = cl_metrics([[0.2, 0.5], [0.7, 0.4]])
    expected = {"acc": 0.7, "average_accuracy": 0.7, "bwt": None, "fwt": None, "plasticity": 0.5}
    assert_headline(result, {**expected, "forgetting": None, "forgetting_from_base": None})  # T - 1 = 0 terms
    assert result["retention"]["probes"][0]["change"] == pytest.approx(-0.1)
    json.dumps(result, allow_nan=False)


def test_cl_metrics_two_stages_by_hand() -> None:
    # T = 2. Domain 0 starts at 0.9, training on it lowers it to 0.6, and stage 2 lowers it to 0.4. Chaudhry et
    # al.'s forgetting takes the max over row 1 only: 0.6 - 0.4; the variant that counts the base row: 0.9 - 0.4.
    # GEM's FWT has T - 1 = 1 term, domain 1 before its stage minus before training: 0.5 - 0.3 (not halved).
    result = cl_metrics([[0.9, 0.3], [0.6, 0.5], [0.4, 0.8]])
    expected = {
        "acc": (0.4 + 0.8) / 2,
        "average_accuracy": (0.6 + (0.4 + 0.8) / 2) / 2,
        "bwt": 0.4 - 0.6,
        "fwt": 0.5 - 0.3,
        "forgetting": 0.6 - 0.4,
        "forgetting_from_base": 0.9 - 0.4,
        "plasticity": ((0.6 - 0.9) + (0.8 - 0.5)) / 2,
    }
    assert_headline(result, expected)


def test_cl_metrics_three_stages_where_the_two_forgettings_differ() -> None:
    # T = 3; domain 1 starts at 0.9 (the base had it), falls to 0.5 in stage 1, is trained to 0.7, ends at 0.6
    acc = [
        [0.2, 0.9, 0.3],
        [0.8, 0.5, 0.3],
        [0.6, 0.7, 0.4],
        [0.5, 0.6, 0.9],
    ]
    result = cl_metrics(acc)
    expected = {
        "bwt": ((0.5 - 0.8) + (0.6 - 0.7)) / 2,
        "fwt": ((0.5 - 0.9) + (0.4 - 0.3)) / 2,  # -0.15 (dividing by T would give -0.1)
        "forgetting": ((max(0.8, 0.6) - 0.5) + (max(0.5, 0.7) - 0.6)) / 2,  # 0.2
        "forgetting_from_base": ((max(0.2, 0.8, 0.6) - 0.5) + (max(0.9, 0.5, 0.7) - 0.6)) / 2,  # 0.3
    }
    assert_headline(result, expected)
    per_domain = {d["column"]: d for d in result["per_domain"]}
    assert per_domain[1]["forgetting"] == pytest.approx(0.1)
    assert per_domain[1]["forgetting_from_base"] == pytest.approx(0.3)


def test_retention_ratio_and_gain_over_base_by_hand() -> None:
    # issue 43's case: the base already answers domain 1 at 0.57; stage 1 (domain 0) drives it to 0.0 and stage 2
    # (domain 1) brings it back to 0.05 only. Chaudhry forgetting sees domain 0 alone; retention_ratio and
    # gain_over_base count domain 1's lost prior skill.
    acc = [[0.10, 0.57], [0.86, 0.00], [0.80, 0.05]]
    result = cl_metrics(acc)
    per_domain = {d["column"]: d for d in result["per_domain"]}
    assert per_domain[0]["retention_ratio"] == pytest.approx(0.80 / 0.86)  # max(0.10, 0.86, 0.80)
    assert per_domain[1]["retention_ratio"] == pytest.approx(0.05 / 0.57)  # the base's 0.57, not stage 2's 0.05
    assert result["retention_ratio"] == pytest.approx((0.80 / 0.86 + 0.05 / 0.57) / 2)
    assert result["gain_over_base"] == pytest.approx(((0.80 - 0.10) + (0.05 - 0.57)) / 2)
    assert result["forgetting"] == pytest.approx(0.86 - 0.80)  # blind to domain 1
    # a run that stops after stage 1 (row 2 = row 1) forgets nothing, yet keeps none of domain 1's prior skill
    skip = cl_metrics([[0.10, 0.57], [0.86, 0.00], [0.86, 0.00]])
    assert skip["forgetting"] == 0.0 and skip["retention_ratio"] == pytest.approx((1.0 + 0.0) / 2)
    assert skip["gain_over_base"] == pytest.approx(((0.86 - 0.10) + (0.0 - 0.57)) / 2)
    # a domain never solved, before or after: nothing to retain, left out of the mean
    never = cl_metrics([[0.0, 0.5], [0.0, 0.6]], trained_columns=[0])
    assert never["per_domain"][0]["retention_ratio"] is None and never["retention_ratio"] is None
    # the max runs from the domain's own first stage: a later domain's accuracy before its stage (above the base)
    # does not count
    late = cl_metrics([[0.2, 0.1], [0.3, 0.9], [0.2, 0.4]])
    assert {d["column"]: d for d in late["per_domain"]}[1]["retention_ratio"] == pytest.approx(1.0)  # 0.4 / 0.4
    json.dumps(result, allow_nan=False)


def test_every_headline_metric_has_a_definition() -> None:
    result = cl_metrics(ACC_4x3)
    headline = {k for k, v in result.items() if isinstance(v, float)}
    assert headline == set(CL_METRIC_DEFINITIONS)


def test_cl_metrics_repeated_domain_uses_first_and_last_stage() -> None:
    acc = [[0.1, 0.2], [0.6, 0.2], [0.4, 0.7], [0.8, 0.5]]  # stages train columns 0, 1, 0
    result = cl_metrics(acc, trained_columns=[0, 1, 0])
    expected = {
        "acc": (0.8 + 0.5) / 2,
        "average_accuracy": (0.6 + (0.4 + 0.7) / 2 + (0.8 + 0.5) / 2) / 3,
        "bwt": 0.5 - 0.7,  # only column 1 was last trained before stage T
        "forgetting": max(0.2, 0.7) - 0.5,  # column 1, over rows 1..T-1
        "forgetting_from_base": max(0.2, 0.2, 0.7) - 0.5,
        "fwt": 0.2 - 0.2,  # only column 1 was first trained after stage 1
        "plasticity": (0.5 + 0.5 + 0.4) / 3,
    }
    assert_headline(result, expected)


def test_report_states_each_definition_next_to_the_value_recomputed_from_the_matrix(tmp_path) -> None:
    from adaptercl.measure.report import write_report

    # a summary written under the old definitions (fwt divided by T, forgetting including row 0): stale values
    summary = {
        "domains": ["a", "b"],
        "stages": ["before", "stage-01-a", "stage-02-b"],
        "accuracy": [[0.9, 0.3], [0.6, 0.5], [0.4, 0.8]],
        "cl_metrics": {"trained_columns": [0, 1], "fwt": 0.1, "forgetting": 0.5},
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    text = write_report(tmp_path).read_text()
    for key, value in {"fwt": "0.2000", "forgetting": "0.2000", "forgetting_from_base": "0.5000"}.items():
        assert f"- {key}: {value} — {CL_METRIC_DEFINITIONS[key]}" in text
    assert "Chaudhry" in CL_METRIC_DEFINITIONS["forgetting"] and "T − 1 terms" in CL_METRIC_DEFINITIONS["fwt"]


def test_stage_forgetting_matches_hand_computation() -> None:
    acc = [
        [0.1, 0.2, 0.3, 0.5],
        [0.5, 0.2, 0.3, 0.5],
        [0.4, 0.6, 0.35, 0.1],  # stage 2 drops domain 0 by 0.1 (the probe column 3 is not counted)
        [0.2, 0.5, 0.9, 0.0],  # stage 3 drops domain 0 by 0.2 and domain 1 by 0.1: mean 0.15
    ]
    got = stage_forgetting(acc, [0, 1, 2])
    assert got[0] is None and got[1:] == pytest.approx([0.1, 0.15])
    # a stage that trains an earlier domain again does not count that domain; an improvement is negative
    got = stage_forgetting([[0.0, 0.0], [0.5, 0.0], [0.4, 0.6], [0.9, 0.8]], [0, 1, 0])
    assert got[0] is None and got[1:] == pytest.approx([0.1, -0.2])
    assert stage_forgetting([[0.0], [1.0]]) == [None]
    with pytest.raises(ValueError, match="3 stages"):
        stage_forgetting([[0.0], [1.0]], [0, 0, 0])


def test_cl_metrics_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="trained_columns"):
        cl_metrics(ACC_4x3, trained_columns=[0, 1])
    with pytest.raises(ValueError, match="out of range"):
        cl_metrics(ACC_4x3, trained_columns=[0, 1, 3])
    with pytest.raises(ValueError, match="T >= 1"):
        cl_metrics([[0.1, 0.2]])


# ---------------------------------------------------------------- parameter drift


def random_matrices(seed: int, out_features: int = 12, in_features: int = 7, scale: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(out_features, in_features, generator=g, dtype=torch.float64)
    delta = scale * torch.randn(out_features, in_features, generator=g, dtype=torch.float64)
    return w0, delta


def numpy_reference(w0: torch.Tensor, delta: torch.Tensor, k: int) -> dict[str, float]:
    scipy_linalg = pytest.importorskip("scipy.linalg")  # in the dev extra; only the tests that need it skip without it
    a, d = w0.numpy(), delta.numpy()
    s0, s1 = np.linalg.svd(a, compute_uv=False), np.linalg.svd(a + d, compute_uv=False)
    u0, _, vh0 = np.linalg.svd(a, full_matrices=False)
    u1, _, vh1 = np.linalg.svd(a + d, full_matrices=False)
    left = scipy_linalg.subspace_angles(u0[:, :k], u1[:, :k]).max()
    right = scipy_linalg.subspace_angles(vh0[:k].T, vh1[:k].T).max()
    return {
        "relative_delta_norm": np.linalg.norm(d) / np.linalg.norm(a),
        "spectral_shift": np.linalg.norm(s1 - s0) / np.linalg.norm(s0),
        "principal_angle": max(left, right),
        "principal_angle_left": left,
        "principal_angle_right": right,
    }


def test_drift_is_exactly_zero_for_zero_delta() -> None:
    w0, _ = random_matrices(0)
    zero = torch.zeros_like(w0)
    assert relative_delta_norm(w0, zero) == 0.0
    assert spectral_shift(w0, zero) == 0.0
    assert principal_angle(w0, zero) == 0.0
    assert set(parameter_drift(w0, zero).values()) == {0.0}


@pytest.mark.parametrize("scale", [1e-3, 0.05, 3.0])  # small angles (arcsin branch) to large (arccos branch)
def test_drift_matches_numpy_and_scipy(scale: float) -> None:
    w0, delta = random_matrices(1, scale=scale)
    expected = numpy_reference(w0, delta, k=3)
    drift = parameter_drift(w0, delta, k=3)
    assert drift == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert relative_delta_norm(w0, delta) == pytest.approx(expected["relative_delta_norm"], rel=1e-9)
    assert spectral_shift(w0, delta) == pytest.approx(expected["spectral_shift"], rel=1e-9)
    assert principal_angle(w0, delta, k=3) == pytest.approx(expected["principal_angle"], rel=1e-6, abs=1e-9)
    assert principal_angle(w0, delta, k=3, side="left") == pytest.approx(expected["principal_angle_left"], abs=1e-9)
    assert principal_angle(w0, delta, k=3, side="right") == pytest.approx(expected["principal_angle_right"], abs=1e-9)


@pytest.mark.parametrize("shape", [(12, 7), (7, 12)])  # tall, and wide (decomposed as its transpose)
def test_spectrum_is_the_svd_and_a_kept_base_spectrum_gives_the_same_drift(shape) -> None:
    w0, delta = random_matrices(5, *shape, scale=0.3)
    spec = spectrum(w0, 3)
    U, s, Vh = torch.linalg.svd(w0, full_matrices=False)
    torch.testing.assert_close(spec.s, s, rtol=1e-12, atol=1e-12)
    assert spec.U.shape == (shape[0], 3) and spec.Vh.shape == (3, shape[1])
    torch.testing.assert_close(spec.U @ torch.diag(spec.s[:3]) @ spec.Vh, U[:, :3] @ torch.diag(s[:3]) @ Vh[:3])
    expected = numpy_reference(w0, delta, k=3)
    assert parameter_drift(w0, delta, k=3, base=spec) == pytest.approx(expected, rel=1e-6, abs=1e-9)
    # a stale or wrong base spectrum shows up in the result: it is really used
    assert parameter_drift(w0, delta, k=3, base=spectrum(2 * w0, 3))["spectral_shift"] > 0.5


def test_drift_float32_path_and_low_precision_inputs() -> None:
    w0, delta = random_matrices(2)
    expected = numpy_reference(w0, delta, k=4)
    drift = parameter_drift(w0.bfloat16(), delta.bfloat16(), k=4, dtype=torch.float32)
    assert drift["relative_delta_norm"] == pytest.approx(expected["relative_delta_norm"], rel=2e-2)
    assert drift["principal_angle"] == pytest.approx(expected["principal_angle"], rel=0.2)


def test_rescaling_w0_shifts_the_spectrum_but_not_the_subspaces() -> None:
    w0, _ = random_matrices(3)
    drift = parameter_drift(w0, 0.5 * w0, k=4)
    assert drift["relative_delta_norm"] == pytest.approx(0.5)
    assert drift["spectral_shift"] == pytest.approx(0.5)
    assert drift["principal_angle"] == pytest.approx(0.0, abs=1e-6)


def test_principal_angle_k_is_clamped_to_the_smaller_dimension() -> None:
    w0, delta = random_matrices(4, scale=0.5)  # [12, 7]
    # the top-7 right subspace is all of R^7, so only the left side can move
    assert principal_angle(w0, delta, k=50, side="right") == pytest.approx(0.0, abs=1e-6)
    assert principal_angle(w0, delta, k=50, side="left") > 0.01


def test_aggregate_drift() -> None:
    per_module = {
        "q": {"relative_delta_norm": 0.1, "spectral_shift": 0.02},
        "v": {"relative_delta_norm": 0.3, "spectral_shift": 0.01},
    }
    out = aggregate_drift(per_module)
    assert out == pytest.approx(
        {
            "relative_delta_norm_mean": 0.2,
            "relative_delta_norm_max": 0.3,
            "spectral_shift_mean": 0.015,
            "spectral_shift_max": 0.02,
        }
    )
    weighted = aggregate_drift(per_module, weights={"q": 3, "v": 1})
    assert weighted["relative_delta_norm_mean"] == pytest.approx((3 * 0.1 + 0.3) / 4)
    assert aggregate_drift({}) == {}
    with pytest.raises(ValueError, match="no weight"):
        aggregate_drift(per_module, weights={"q": 1})


# ---------------------------------------------------------------- response drift


def test_token_kl_and_js_match_hand_computation() -> None:
    p = torch.tensor([[[0.5, 0.5], [1.0, 0.0], [0.01, 0.99]]])  # [N=1, T=3, V=2]
    q = torch.tensor([[[0.25, 0.75], [0.5, 0.5], [0.99, 0.01]]])
    mask = torch.tensor([[1, 1, 0]])  # the third token is padding and must not count
    kl = [0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75), math.log(1.0 / 0.5)]
    assert token_kl(p.log(), q.log(), mask) == pytest.approx(sum(kl) / 2, rel=1e-6)

    def kl2(a: list[float], b: list[float]) -> float:
        return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)

    js = []
    for pi, qi in ([[0.5, 0.5], [0.25, 0.75]], [[1.0, 0.0], [0.5, 0.5]]):
        m = [(x + y) / 2 for x, y in zip(pi, qi)]
        js.append(0.5 * kl2(pi, m) + 0.5 * kl2(qi, m))
    assert token_js(p.log(), q.log(), mask.bool()) == pytest.approx(sum(js) / 2, rel=1e-6)


def test_token_kl_matches_torch_kl_div_and_js_bounds() -> None:
    g = torch.Generator().manual_seed(5)
    logp = torch.log_softmax(torch.randn(2, 4, 11, generator=g), dim=-1)  # [N, T, V]
    logq = torch.log_softmax(torch.randn(2, 4, 11, generator=g), dim=-1)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    ref = torch.nn.functional.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)  # [N, T]
    assert token_kl(logp, logq, mask) == pytest.approx((ref * mask).sum().item() / 4, rel=1e-5)
    assert token_kl(logp, logp, mask) == 0.0 and token_js(logp, logp, mask) == pytest.approx(0.0, abs=1e-7)
    disjoint_p, disjoint_q = torch.tensor([[[1.0, 0.0]]]).log(), torch.tensor([[[0.0, 1.0]]]).log()
    assert token_js(disjoint_p, disjoint_q, torch.ones(1, 1)) == pytest.approx(math.log(2.0))
    assert math.isnan(token_kl(logp, logq, torch.zeros(2, 4)))


def test_mean_entropy() -> None:
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf], [9.0, 0.0, 0.0, 0.0]]])
    mask = torch.tensor([[1, 1, 0]])
    hand = [math.log(4.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    assert mean_entropy(logits, mask) == pytest.approx(sum(hand) / 2, rel=1e-6)
    assert math.isnan(mean_entropy(logits, torch.zeros(1, 3)))


def test_repeated_ngram_rate() -> None:
    seq = [1, 2, 3, 1, 2, 3, 1, 2]
    assert repeated_ngram_rate(seq, n=3) == pytest.approx(3 / 6)  # 123 231 312 | 123 231 312
    assert repeated_ngram_rate(seq, n=2) == pytest.approx(4 / 7)
    assert repeated_ngram_rate([7, 7, 7, 7, 7], n=2) == pytest.approx(3 / 4)
    assert repeated_ngram_rate(list(range(10)), n=4) == 0.0
    assert repeated_ngram_rate([1, 2], n=4) == 0.0


def test_pattern_rate() -> None:
    texts = ["The answer is \\boxed{4}.", "call search(x)", "<tool_call>{}</tool_call> \\boxed{1}", "plain"]
    assert pattern_rate(texts, [r"\\boxed"]) == pytest.approx(0.5)
    assert pattern_rate(texts, [r"\\boxed", r"<tool_call>"]) == pytest.approx(0.5)
    assert pattern_rate(texts, [r"search\(", r"^plain$"]) == pytest.approx(0.5)
    assert pattern_rate(texts, []) == 0.0
    assert math.isnan(pattern_rate([], [r"\\boxed"]))
