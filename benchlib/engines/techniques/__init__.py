"""Step techniques of a model file: one interface (`Technique`), benchlib's own (`builtin`), a model
file's own (`TECHNIQUES = {"name": Class}`) and an installed package's (entry-point group
`benchlib.techniques`), joined with `+` into one step (`Combination`, run by `Step`).

    registry = technique_registry(model_file.techniques)
    combination = combine("torch-autocast+torch-checkpoint", registry, TechniqueOptions(microbatches=2))
    combination.not_applicable(model, StepFacts(has_optimizer=True, has_step=False, device_kind="cpu"))
    Step(combination, model, batch, loss, optimizer)()
"""

from benchlib.engine_names import REFERENCE
from benchlib.engines.techniques.base import (Aspect, Combination, CombinationError, Need, StepFacts, Technique,
                                              TechniqueFault, TechniqueOptions, combine)
from benchlib.engines.techniques.builtin import BUILTIN
from benchlib.engines.techniques.parallel import PARALLEL
from benchlib.engines.techniques.registry import (ALL, COMBINATION_CHOICES, COMPILING, DEFAULT, ENTRY_POINT_GROUP, NONE,
                                                  SWEEP, added_combinations, check_technique, installed_techniques,
                                                  placement_of, stand_in, technique_registry)
from benchlib.engines.techniques.step import Step

__all__ = ["Aspect", "Combination", "CombinationError", "Need", "Step", "StepFacts", "Technique", "TechniqueFault",
           "TechniqueOptions", "BUILTIN", "PARALLEL", "REFERENCE", "SWEEP", "COMPILING", "COMBINATION_CHOICES", "ALL",
           "DEFAULT", "NONE", "ENTRY_POINT_GROUP", "technique_registry", "combine", "added_combinations",
           "check_technique", "installed_techniques", "placement_of", "stand_in"]
