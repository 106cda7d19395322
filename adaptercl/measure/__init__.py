"""What a run measures and reports: greedy evaluation of every domain (`evaluate.py`), continual-learning and
response-drift metrics (`metrics.py`, pure, used whole as a namespace), parameter drift (`weight_drift.py` and
`lowrank_drift.py`, pure; `drift.py` on the live model), statistics of the diagnostics (`stats.py`), the
formatting-artifact diagnostic (`artifacts.py`, pure), lm-eval retention probes (`lm_eval.py`), the run report
(`report.py`) and experiment trackers (`trackers.py`); multiple-choice probes scored by log-likelihood
(`choice_scoring.py`).
"""

from importlib import import_module

# name other folders use -> the module of this folder that defines it; a name equal to its module's is the module
# itself. Imported on first use: importing the folder loads nothing.
_EXPORTS = {
    "formatting_artifacts": "artifacts",
    "stage_artifacts": "artifacts",
    "BaseWeights": "drift",
    "parameter_drift_report": "drift",
    "response_drift": "drift",
    "evaluate_all": "evaluate",
    "evaluate_choices": "choice_scoring",
    "loglikelihood_domains": "choice_scoring",
    "check_tasks": "lm_eval",
    "lm_eval_probes": "lm_eval",
    "cl_metrics": "metrics",
    "repeated_ngram_rate": "metrics",
    "ROWS_PER_FORWARD": "policy_divergence",
    "divergence_sums": "policy_divergence",
    "token_chunk": "policy_divergence",
    "token_scores": "policy_divergence",
    "write_report": "report",
    "paired_bootstrap_interval": "stats",
    "sign_test_p": "stats",
    "require_trackers": "trackers",
    "tracking": "trackers",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = import_module(f"{__name__}.{_EXPORTS[name]}")
        return module if _EXPORTS[name] == name else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
