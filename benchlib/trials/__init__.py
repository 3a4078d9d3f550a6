"""Trials: the one loop that runs an engine comparison's cases in fresh processes (`loop`), and the rule
that says when a case has run enough of them (`stopping`)."""

from benchlib.trials.loop import (GRAD_UNCHECKED_METRIC, Interrupted, TrialLoop, TrialSettings, Unit,
                                  child_start_params, stopping_rule, trial_order)
from benchlib.trials.stopping import (BUDGET, DETERMINISTIC, MAX_TRIALS, PRECISION, TRIALS_RUN, Deadline,
                                      TrialStopping)

__all__ = ["BUDGET", "DETERMINISTIC", "GRAD_UNCHECKED_METRIC", "Interrupted", "MAX_TRIALS", "PRECISION", "TRIALS_RUN", "Deadline",
           "TrialLoop", "TrialSettings", "TrialStopping", "Unit", "child_start_params", "stopping_rule",
           "trial_order"]
