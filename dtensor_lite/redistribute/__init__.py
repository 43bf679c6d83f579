"""Redistribute: plan (cheapest per-mesh-dim steps) and execute (collectives on local tensors)."""
from .planner import RedistributePlan, Step, plan_redistribute
from .executor import run_plan
from .entry import explain_redistribute, redistribute_local, redistribute_locals, redistribute_target

__all__ = ["RedistributePlan", "Step", "explain_redistribute", "plan_redistribute", "run_plan",
           "redistribute_local", "redistribute_locals", "redistribute_target"]
