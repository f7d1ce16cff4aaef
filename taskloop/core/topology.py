"""Which topology a workflow has: a DAG of tasks (dag.py) or a graph workflow (graph_plan.py)."""

from __future__ import annotations

from taskloop.core.dag import DAG
from taskloop.core.graph_plan import GRAPH
from taskloop.core.plan import Topology
from taskloop.define.workflow import Workflow


def topology_of(workflow: Workflow) -> Topology:
    return DAG if workflow.graph is None else GRAPH
