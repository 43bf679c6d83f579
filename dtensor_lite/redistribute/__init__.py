"""Redistribute: plan (cheapest per-mesh-dim steps) and execute (collectives on local tensors)."""
from .planner import RedistributePlan, Step, explain_redistribute, plan_redistribute
from .executor import run_plan

__all__ = ["RedistributePlan", "Step", "explain_redistribute", "plan_redistribute", "run_plan"]
