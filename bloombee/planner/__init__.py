"""DP pipeline planner: layer ranges, KV offload fractions, batch size and micro-batches.

```python
from bloombee.planner import PlanInputs, evaluate, plan, brute_force, baselines

inputs = PlanInputs.from_file("examples/plans/e5.yaml")   # PlanInputError names the bad fields
best = plan(inputs)                  # Plan: assignment (blocks per node), batch_size, micro_batches,
                                     #       alphas, throughput (tokens/s), evaluation, candidates
best.evaluation.stages[0].t_comp_s   # per-stage times, memory, outgoing hop (compressed or not)
evaluate(inputs, [20, 20, 20], batch_size=32, micro_batches=4)   # any assignment, or why infeasible
baselines(inputs)["greedy"].throughput                            # even split / Petals-style greedy
```

The model of a step is in ``costs`` and ``evaluate``; the dynamic program in ``dp``. See README.md.
"""

from .baselines import BaselineResult, baselines, even_split, greedy
from .brute import brute_force
from .costs import StepModel, micro_batch_size
from .dp import Solution, solve
from .evaluate import Evaluation, HopResult, StageResult, evaluate
from .inputs import ModelSpec, NodeProfile, NodeSpec, PlanInputError, PlanInputs, WorkloadSpec
from .model_config import ModelConfigError, load_model_section, model_section_from_config
from .search import Candidate, Plan, PlanInfeasibleError, plan

__all__ = [
    "BaselineResult",
    "Candidate",
    "Evaluation",
    "HopResult",
    "ModelConfigError",
    "ModelSpec",
    "NodeProfile",
    "NodeSpec",
    "Plan",
    "PlanInfeasibleError",
    "PlanInputError",
    "PlanInputs",
    "Solution",
    "StageResult",
    "StepModel",
    "WorkloadSpec",
    "baselines",
    "brute_force",
    "even_split",
    "evaluate",
    "greedy",
    "load_model_section",
    "micro_batch_size",
    "model_section_from_config",
    "plan",
    "solve",
]
